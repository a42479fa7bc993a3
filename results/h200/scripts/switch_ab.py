"""Engine switches A/B in one process, the engines taking turns (``auto_ab.run_interleaved``):
host_ab.py's alternating processes on session 38's H100 host spread 0.72-1.36x between rounds of
one configuration, as large as what was measured. Here a base engine and one engine per switch
set run the same closed loop at once, turns of ``--turn`` steps each, the order rotated every
cycle, so every engine sees the same host; each round's ratio is of whole runs (each engine's
time the sum of its turns), and ``turn_ratios`` keeps each cycle's ratio to the base.

    python3 switch_ab.py MODEL_DIR OUT.json --variant early:early_head_catch_up=1 [--variant ...]
        [--base=SWITCH,...] [--configs 2:16:1024,2:1:96] [--rounds 3] [--turn 64]

A switch is an Engine attribute set to 0|1 after the build (``early_head_catch_up=1``), ``K=N``
(the engine's draft count instead of the config's: ``--variant k0:K=0`` beside K=2), a
scheduler setting replaced after the build (``scheduler.admission_group=0.5``: the scheduler reads
its config at each step), or ``--[no-]prompt-graphs`` / ``--[no-]step-recordings`` for the engine's
settings (both on by default with CUDA graphs); ``--base`` gives the base engine's. A config is K:C:REQUESTS; every request 128 tokens (waves, as host_ab.py's), or with
``--range-ratio R`` lengths drawn from 128 x [1 - R, 1 + R] (seeded: the same for every engine),
as the bench's and step_timeline.py's 0.5. Start-up
is frozen out of the cycle collector once the engines are built, as a serving process runs.
Prints one line a config and round; OUT.json keeps every run.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from auto_ab import run_interleaved  # noqa: E402

from mtpserve.cluster.bench.engine_driver import recording_counts, start_up_frozen  # noqa: E402
from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, output_lengths, text_workload  # noqa: E402
from mtpserve.engine.config import EngineConfig, SpecConfig  # noqa: E402
from mtpserve.engine.engine import Engine  # noqa: E402

SETTINGS = {"--prompt-graphs": ("prompt_graphs", True), "--no-prompt-graphs": ("prompt_graphs", False),
            "--step-recordings": ("step_recordings", True), "--no-step-recordings": ("step_recordings", False)}


def build(model_dir: str, device: str, k: int, switches: list[str]) -> Engine:
    """An engine of K drafts with ``switches`` (settings before the build, attributes after;
    ``K=N``: N drafts instead, e.g. K=0 beside K=2 engines, for their ratio in the same turns)."""
    settings = dict(SETTINGS[x] for x in switches if x in SETTINGS)
    k = next((int(x[2:]) for x in switches if x.startswith("K=")), k)
    engine = Engine(EngineConfig(model_dir, device=device, spec=SpecConfig(k), **settings))
    for x in switches:
        if x in SETTINGS or x.startswith("K="):
            continue
        attr, value = x.split("=")
        if attr.startswith("scheduler."):
            config, name = engine.scheduler.config, attr.removeprefix("scheduler.")
            if not hasattr(config, name):
                raise SystemExit(f"no scheduler setting {name}")
            engine.scheduler.config = dataclasses.replace(config, **{name: type(getattr(config, name))(value)})
            engine.scheduler.config.validate()
            continue
        if not hasattr(engine, attr):
            raise SystemExit(f"no engine attribute {attr}")
        setattr(engine, attr, bool(int(value)))
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--variant", action="append", required=True, metavar="LABEL:SWITCH,...")
    p.add_argument("--base", default="", metavar="SWITCH,...", help="the base engine's switches")
    p.add_argument("--configs", default="2:16:1024,2:1:96")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--turn", type=int, default=64, help="steps an engine runs before the next takes its turn")
    p.add_argument("--range-ratio", type=float, default=0.0, help="output lengths 128 x [1 - R, 1 + R] (0: waves)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    base = [x for x in args.base.split(",") if x]
    variants = {label: [*base, *[x for x in rest.split(",") if x]]
                for label, rest in (v.split(":", 1) for v in args.variant)}
    runs = []
    for config in args.configs.split(","):
        k, c, n = (int(x) for x in config.split(":"))
        engines = {"base": build(args.model_dir, args.device, k, base)}
        engines.update({label: build(args.model_dir, args.device, k, sw) for label, sw in variants.items()})
        prompts = text_workload(BUNDLED_PROMPTS, engines["base"].tokenizer.encode, n).prompt_ids
        lengths = output_lengths(n, 128, args.range_ratio) or 128
        run_interleaved(engines, prompts[:max(32, 2 * c)], c, "warm", args.turn, reference="base")
        ratios = {label: [] for label in variants}
        with start_up_frozen():           # (the bench's: unfrozen after, so these engines can go)
            for r in range(args.rounds):
                before = {label: e.step_recordings.stats() for label, e in engines.items()
                          if e.step_recordings is not None}
                out = run_interleaved(engines, prompts, c, f"r{r}", args.turn, lengths, reference="base")
                for label, stats in before.items():        # the round's recorded draft steps, and why not
                    out[label]["step_recordings"] = recording_counts(stats, engines[label].step_recordings.stats())
                for label in variants:
                    ratios[label].append(out[label]["tok_s"] / out["base"]["tok_s"])
                runs.append({"k": k, "c": c, "requests": n, "range_ratio": args.range_ratio, "round": r, "runs": out})
                print(f"K={k} C={c} round {r + 1}: base {out['base']['tok_s']:.0f} tok/s; " + ", ".join(
                    f"{label} {out[label]['tok_s']:.0f} ({ratios[label][-1]:.3f}x, turns median "
                    f"{statistics.median(out[label]['turn_ratios'] or [0]):.3f}x)" for label in variants), flush=True)
        for label in variants:
            print(f"K={k} C={c}: {label}/base median {statistics.median(ratios[label]):.3f}x "
                  f"({', '.join(f'{x:.3f}' for x in ratios[label])})", flush=True)
        del engines
        gc.collect()
    Path(args.out).write_text(json.dumps({"model": args.model_dir, "base": base, "variants": variants, "runs": runs}))


if __name__ == "__main__":
    main()
