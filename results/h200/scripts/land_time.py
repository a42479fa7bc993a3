"""Host time of landing a launched step (``Engine._land``) and its parts, per landed step, in one
engine's closed loop (bundled model, every request 128 tokens, the bench's pools: as many state
rows and step slots as clients, CUDA's scheduling rules on any device). Session 36 ran it on the
CPU, this checkout against a base one in alternating processes:

    PYTHONPATH=/tmp/pkg_base python3 land_time.py 2 16 128    # the base checkout's engine
    python3 land_time.py 2 16 128                             # this one's
    (K, C, requests; --device cuda for a GPU)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spy_loop import measured, warm_up  # noqa: E402

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, text_workload  # noqa: E402
from mtpserve.engine.bundled import MODEL_DIR  # noqa: E402
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
    p.add_argument("k", type=int)
    p.add_argument("c", type=int)
    p.add_argument("requests", type=int)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    scheduler = SchedulerConfig(max_requests_per_step=a.c, max_tokens_per_step=2048,
                                admission_hold_steps=CUDA_ADMISSION_HOLD_STEPS)
    engine = Engine(EngineConfig(str(MODEL_DIR), device=a.device, spec=SpecConfig(a.k), scheduler=scheduler,
                                 cache=CacheConfig(max_resident_requests=a.c), overlap_decode=True))
    engine.scheduler.uniform_drafts = bool(a.k)          # CUDA's rules (as host_ab.py --cuda-rules)
    engine.draft_after_decode = engine.overlap
    prompts = text_workload(BUNDLED_PROMPTS, engine.tokenizer.encode, a.requests).prompt_ids
    warm_up(engine, prompts[:2 * a.c], a.c, 128)
    spent: dict[str, list[float]] = {}

    def timed(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                s = spent.setdefault(label, [0.0, 0])
                s[0] += time.perf_counter() - t
                s[1] += 1
        setattr(owner, name, wrapped)
    timed(engine, "_land", "land")
    timed(engine, "_events", "events")
    timed(engine.scheduler, "append_tokens", "append_tokens")
    timed(engine.scheduler, "cache_prefixes", "cache_prefixes")
    timed(engine.scheduler, "commit_lengths", "commit_lengths")
    r = measured(engine, prompts, a.c, 128)
    lands = spent["land"][1]
    print(f"K={a.k} C={a.c}: {r['steps']} steps; us per landed step: "
          + ", ".join(f"{label} {s[0] / lands * 1e6:.0f}" for label, s in spent.items()))


if __name__ == "__main__":
    main()
