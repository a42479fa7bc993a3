"""One checkout's closed loops on the bundled model, for an A/B of two checkouts' host paths
in alternating processes (``session.sh dj``: the base commit's engine beside this one's, rounds
alternating, since the device host's speed drifts between runs): each config a warm-up run
then a measured one; one JSON line a config.

    python3 host_ab.py MODEL_DIR LABEL [--configs 2:16:1024,0:16:1024,2:1:96] >> runs.jsonl

A config is K:C:REQUESTS (draft tokens, concurrency, requests; every request 128 tokens, so a
closed loop's requests arrive in waves, as the issue's bench has them). ``--resident C`` gives
the engines the bench's pools (as many state rows and step slots as clients); ``--device cpu
--cuda-rules`` runs CUDA's scheduling rules (uniform drafts, admission holds, a draft step after
a decode step) on the CPU, for counts of steps, prompt steps and stops (no timing: a CPU's).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spy_loop import measured, warm_up  # noqa: E402

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, text_workload  # noqa: E402
from mtpserve.engine.config import (  # noqa: E402
    CUDA_ADMISSION_HOLD_STEPS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpecConfig,
)
from mtpserve.engine.engine import Engine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("label")
    p.add_argument("--configs", default="2:16:1024,0:16:1024,2:1:96")
    p.add_argument("--device", default="cuda")
    p.add_argument("--set", action="append", default=[], metavar="PATH=0|1",
                   help="an engine switch for this run, e.g. carry_dead_rows=0 or graphs.steady_staging=0 "
                        "(one checkout A/B'd against itself, feature by feature)")
    p.add_argument("--scheduler", action="append", default=[], metavar="FIELD=VALUE",
                   help="a SchedulerConfig field for this run, e.g. admission_group=0.5")
    p.add_argument("--resident", type=int, default=None,
                   help="state rows and step slots (the bench's pools: its concurrency); default the engine's")
    p.add_argument("--cuda-rules", action="store_true", help="CUDA's scheduling rules on another device")
    p.add_argument("--prompt-graphs", action="store_true", help="EngineConfig.prompt_graphs: captured prompt steps")
    p.add_argument("--step-recordings", action="store_true",
                   help="EngineConfig.step_recordings: steady draft steps launched as recordings of ours")
    p.add_argument("--land-times", action="store_true",
                   help="the host time of landing a step (Engine._land) and its parts, us per landed step")
    args = p.parse_args()
    cache, scheduler = CacheConfig(), SchedulerConfig()
    if args.resident:
        cache = CacheConfig(max_resident_requests=args.resident)
        scheduler = SchedulerConfig(max_requests_per_step=args.resident)
    if args.cuda_rules:
        scheduler = dataclasses.replace(scheduler, max_tokens_per_step=2048, admission_hold_steps=CUDA_ADMISSION_HOLD_STEPS)
    engines = {}
    for config in args.configs.split(","):
        k, c, n = (int(x) for x in config.split(":"))
        if k not in engines:
            engines[k] = Engine(EngineConfig(args.model_dir, device=args.device, spec=SpecConfig(k), cache=cache,
                                             scheduler=scheduler, overlap_decode=True if args.cuda_rules else None,
                                             prompt_graphs=args.prompt_graphs, step_recordings=args.step_recordings))
            if args.cuda_rules:
                engines[k].scheduler.uniform_drafts = bool(k)
                engines[k].draft_after_decode = engines[k].overlap
                engines[k].early_head_catch_up = engines[k].prompt_continuations = engines[k].land_prompts_first
            for switch in args.set:
                path, value = switch.split("=")
                *owners, name = path.split(".")
                owner = engines[k]
                for attr in owners:
                    owner = getattr(owner, attr)
                if owner is None:           # (graphs.* on an engine without CUDA graphs)
                    print(f"switch {path}: this engine has no {'.'.join(owners)}; not set", file=sys.stderr)
                elif not hasattr(owner, name):
                    raise SystemExit(f"no switch {path}")
                else:
                    setattr(owner, name, bool(int(value)))
            if args.land_times:
                _time_landing(engines[k])
            config = engines[k].scheduler.config
            for field in args.scheduler:
                name, value = field.split("=")
                config = dataclasses.replace(config, **{name: type(getattr(config, name))(value)})
            engines[k].scheduler.config = config
        engine = engines[k]
        prompts = text_workload(BUNDLED_PROMPTS, engine.tokenizer.encode, n).prompt_ids
        warm_up(engine, prompts[:max(32, 2 * c)], c, 128)
        gc.collect()
        gc.freeze()       # as a serving process and the bench (session 38): no full collection rescans start-up
        stops0, carried0 = dict(engine.overlap_blockers), getattr(engine, "num_dead_carried", 0)
        prompt_graphs = getattr(engine, "prompt_graphs", None)
        replays0 = prompt_graphs.num_replays if prompt_graphs is not None else 0
        spent = getattr(engine, "land_spent", None)
        if spent is not None:
            spent.clear()            # (the warm-up's landings left out)
        r = measured(engine, prompts, c, 128)
        stops = {why: n - stops0.get(why, 0) for why, n in engine.overlap_blockers.items() if n > stops0.get(why, 0)}
        print(json.dumps({"label": args.label, "k": k, "c": c, "requests": n, "tok_s": r["tok_s"],
                          "ms_per_step": r["ms_per_step"], "step_p50_ms": r["step_p50_ms"], "steps": r["steps"],
                          "prompt_steps": r["prompt_steps"], "seconds_by_step": r["seconds_by_step"],
                          "ttft_p50_ms": r.get("ttft_p50_ms"), "stops": stops,
                          "dead_rows_carried": getattr(engine, "num_dead_carried", 0) - carried0,
                          "prompt_replays": prompt_graphs.num_replays - replays0 if prompt_graphs is not None else None,
                          "prompt_graphs_off": getattr(engine, "prompt_graphs_off", None),
                          "step_recordings": engine.step_recordings.stats()
                          if getattr(engine, "step_recordings", None) is not None else None,
                          "land_us": {part: round(t / spent["land"][1] * 1e6, 1) for part, (t, _) in spent.items()}
                          if spent else None}),
              flush=True)
        engine.check_integrity()


def _time_landing(engine) -> None:
    """Wrap ``Engine._land`` and the parts of it that scale with the step's requests; their
    seconds and calls go to ``engine.land_spent``."""
    spent = engine.land_spent = {}

    def timed(owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                s = spent.setdefault(part, [0.0, 0])
                s[0] += time.perf_counter() - t
                s[1] += 1
        setattr(owner, name, wrapped)
    timed(engine, "_land", "land")
    timed(engine, "_events", "events")
    timed(engine.scheduler, "append_tokens", "append_tokens")
    timed(engine.scheduler, "cache_prefixes", "cache_prefixes")
    timed(engine.scheduler, "commit_lengths", "commit_lengths")


if __name__ == "__main__":
    main()
