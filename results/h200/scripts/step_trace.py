"""Every step of auto against an MTP engine that never drafts (and K=0), interleaved: where
auto's time goes step by step, not only in sum (auto_ab.py's rounds say how much, not where).

    python3 step_trace.py MODEL_DIR OUT.json [--device cuda] [--concurrency 16] [--requests 128] [--rounds 2] [--range-ratio 0.5]
        [--fixed 2]

The engines take turns of 64 steps (auto_ab.py's ``run_interleaved``), each a closed loop of C
greedy requests of 128 tokens (or lengths from 128 x [1 - R, 1 + R] with --range-ratio R) over
the bundled prompts. Each step's record: its index in the run, wall ms, whether overlapped
decoding had launched it (``pipelined``), whether it fed a prompt, its head forwards and rows,
and the draft depths the policy was asked for during the step (``planned``: with overlapped
decoding the next step's plan is asked while this one runs, so a drafting step's own plan shows
in the step before it). The summary (the last round) splits each engine's time into prompt
steps, steps launched alone, overlapped decode steps and drafting steps, and lists the slowest.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from auto_ab import run_interleaved  # noqa: E402

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, output_lengths, text_workload  # noqa: E402
from mtpserve.engine.config import EngineConfig, SpecConfig  # noqa: E402
from mtpserve.engine.draft_policy import FixedDraftPolicy  # noqa: E402
from mtpserve.engine.engine import Engine  # noqa: E402


def trace(engines: dict, prompts: list, concurrency: int, rounds: int, turn: int = 64,
          lengths: int | list[int] = 128) -> dict:
    """{engine name: [step record, ...]} over ``rounds`` of auto_ab.py's ``run_interleaved``."""
    recs = {n: [] for n in engines}
    planned = {n: [] for n in engines}
    for n, e in engines.items():
        ask = e.draft_policy.step_drafts

        def step_drafts(requests, uniform, ask=ask, out=planned[n]):
            depths = ask(requests, uniform)
            out.append(depths[0] if depths else -1)
            return depths
        e.draft_policy.step_drafts = step_drafts
    for r in range(rounds):
        def record(name, loop, r=r):
            s, asked = loop.engine.last_step, planned[name]
            recs[name].append({"round": r, "i": len(loop.times) - 1, "ms": round(loop.times[-1] * 1e3, 4),
                               "pipelined": None if s is None else s.pipelined,
                               "prompt": None if s is None else s.has_prefill,
                               "head_forwards": 0 if s is None else s.num_head_forwards,
                               "head_rows": 0 if s is None else s.num_head_rows,
                               "rows": 0 if s is None else s.num_main_tokens,
                               "planned": asked[:]})
            asked.clear()
        run_interleaved(engines, prompts, concurrency, f"r{r}", turn, lengths, on_step=record)
    return recs


def summary(steps: list[dict]) -> dict:
    """The steps' time by kind: prompt steps, steps launched alone, overlapped decode steps."""
    def part(xs):
        ms = [x["ms"] for x in xs]
        return {"steps": len(ms), "ms": round(sum(ms), 2),
                "mean_ms": round(statistics.mean(ms), 4) if ms else None,
                "p50_ms": round(statistics.median(ms), 4) if ms else None}
    return {"all": part(steps), "prompt": part([x for x in steps if x["prompt"]]),
            "alone": part([x for x in steps if not x["prompt"] and x["pipelined"] is False]),
            "overlapped": part([x for x in steps if not x["prompt"] and x["pipelined"]]),
            "drafting": part([x for x in steps if x["head_forwards"]]),
            "slowest": sorted(steps, key=lambda x: -x["ms"])[:16]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--range-ratio", type=float, default=0.0, help="output lengths from 128 x [1 - R, 1 + R]")
    p.add_argument("--fixed", default="", help="fixed draft counts traced beside them, e.g. 2 (a K=2 step's wall "
                   "time at a steady depth against K=0's overlapped steps)")
    p.add_argument("--after-decode", action="store_true", help="also auto and each fixed K with "
                   "Engine.draft_after_decode on (a draft step launched behind a decode step)")
    p.add_argument("--only", default="", help="the engines to trace, by name, K=0 among them (default: all), "
                   "e.g. 'K=0,K=2,K=2 after decode'")
    args = p.parse_args()
    base = EngineConfig(args.model_dir, device=args.device, overlap_decode=True)

    def engine(k, policy=None, after_decode=False):
        e = Engine(dataclasses.replace(base, spec=SpecConfig(k)), draft_policy=policy)
        e.draft_after_decode = after_decode
        return e
    make = {"K=0": functools.partial(engine, 0), "auto": functools.partial(engine, "auto"),
            "never drafts": functools.partial(engine, "auto", FixedDraftPolicy(0))}
    for k in filter(None, args.fixed.split(",")):
        make[f"K={k}"] = functools.partial(engine, int(k))
        if args.after_decode:
            make[f"K={k} after decode"] = functools.partial(engine, int(k), after_decode=True)
    if args.after_decode:
        make["auto after decode"] = functools.partial(engine, "auto", after_decode=True)
    only = [n.strip() for n in args.only.split(",")] if args.only else list(make)
    if "K=0" not in only or not set(only) <= set(make):
        raise SystemExit(f"--only: K=0 and any of {list(make)}")
    engines = {n: make[n]() for n in only}           # (each builds its captures: ~20 s on the H100)
    prompts = text_workload(BUNDLED_PROMPTS, engines["K=0"].tokenizer.encode, args.requests).prompt_ids
    recs = trace(engines, prompts, args.concurrency, args.rounds,
                 lengths=output_lengths(len(prompts), 128, args.range_ratio) or 128)
    out = {"model": args.model_dir, "device": args.device, "concurrency": args.concurrency,
           "requests": args.requests, "rounds": args.rounds, "range_ratio": args.range_ratio, "steps": recs,
           "summary": {n: summary([x for x in s if x["round"] == args.rounds - 1]) for n, s in recs.items()},
           "overlap_blockers": {n: dict(e.overlap_blockers) for n, e in engines.items()}}      # whole run
    Path(args.out).write_text(json.dumps(out))
    for n, s in out["summary"].items():
        print(f"{n}: " + "  ".join(f"{k} {v['steps']} steps {v['ms']} ms (mean {v['mean_ms']}, p50 {v['p50_ms']})"
                                   for k, v in s.items() if k != "slowest"), flush=True)
        print(f"    why a step could not follow the one in flight (whole run): {out['overlap_blockers'][n]}")
        for x in s["slowest"][:10]:
            print("    ", {k: x[k] for k in ("i", "ms", "pipelined", "prompt", "head_forwards", "head_rows", "rows",
                                            "planned")})


if __name__ == "__main__":
    main()
