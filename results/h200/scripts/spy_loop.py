"""One engine's closed loop, long enough for a sampling profiler to see its steady steps:
py-spy (--nonblocking, so the engine runs at its own speed; --idle, so the waits for the device
count) records it, and ``spy_table.py`` turns the stacks into where a step's wall time goes.

    py-spy record --nonblocking --idle -r 1000 -f raw -o K2.txt -- \
        python3 spy_loop.py MODEL_DIR --draft-tokens 2 [--concurrency 16] [--requests 256] [--range-ratio 0]

A warm-up run of the same load comes first (its samples sit under ``warm_up``, the measured run's
under ``measured``: spy_table keeps those). Prints the run's tokens/s and steps.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from auto_ab import ClosedLoop  # noqa: E402

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, output_lengths, text_workload  # noqa: E402
from mtpserve.engine.config import EngineConfig, SpecConfig  # noqa: E402
from mtpserve.engine.engine import Engine  # noqa: E402


def warm_up(engine, prompts, concurrency, lengths) -> None:
    """A closed loop whose samples sit under this frame (left out of spy_table's count)."""
    ClosedLoop(engine, prompts, concurrency, f"warm-{next(_RUNS)}", lengths).advance()


def measured(engine, prompts, concurrency, lengths) -> dict:
    """A closed loop whose samples sit under this frame (spy_table's); its ``result()``."""
    loop = ClosedLoop(engine, prompts, concurrency, f"run-{next(_RUNS)}", lengths)
    loop.advance()
    return loop.result()


_RUNS = itertools.count()      # request ids stay unique when one engine runs several loops


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--draft-tokens", default="2")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    k = args.draft_tokens if args.draft_tokens == "auto" else int(args.draft_tokens)
    engine = Engine(EngineConfig(args.model_dir, device=args.device, spec=SpecConfig(k)))
    prompts = text_workload(BUNDLED_PROMPTS, engine.tokenizer.encode, args.requests).prompt_ids
    lengths = output_lengths(len(prompts), 128, args.range_ratio) or 128
    warm_up(engine, prompts[:max(32, args.concurrency * 2)], args.concurrency, 128)
    r = measured(engine, prompts, args.concurrency, lengths)
    print(f"K={k} C={args.concurrency}: {r['tok_s']} tok/s, {r['steps']} steps, {r['ms_per_step']} ms/step "
          f"(p50 {r['step_p50_ms']}), prompt steps {r['prompt_steps']}, seconds by step {r['seconds_by_step']}")


if __name__ == "__main__":
    main()
