"""Eager step shapes and what their first call costs (CUDA): a developer check for start-up warm-up.

    python -m mtpserve.cluster.bench.first_calls MODEL_DIR [OUT.json]

Builds an engine (CUDA graphs on, the default), then times eager main-model forwards of prompt
chunks: each shape (requests x tokens per request) is run three times; a first call much slower
than the repeats is a cost live traffic would pay unless the start-up warm-up pays it.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np


def main(argv: list[str]) -> int:
    import cupy

    from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from mtpserve.engine.engine import Engine
    from mtpserve.engine.runner import PackedRows
    model = argv[0]
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model, device="cuda", cache=CacheConfig(max_resident_requests=64),
                                 scheduler=SchedulerConfig(max_tokens_per_step=4096, max_requests_per_step=64)))
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    spec, runner = engine.state_bank.spec, engine.runner
    shapes = [(1, 128), (1, 512), (4, 128), (32, 16), (8, 64), (16, 32), (7, 73), (64, 8), (2, 1024),
              (4, 1024), (1, 2048), (1, 4096), (3, 100), (32, 16), (5, 5), (64, 1), (33, 1), (3, 2)]
    results = []
    with engine.device_context():
        for batch, per in shapes:
            times = []
            for _ in range(3):
                rows = [PackedRows([1] * per, 0, []) for _ in range(batch)]
                cupy.cuda.get_current_stream().synchronize()
                s = time.perf_counter()
                runner.run_main(rows, spec.zero_states(batch, cupy), np.zeros(batch, np.int32))
                cupy.cuda.get_current_stream().synchronize()
                times.append((time.perf_counter() - s) * 1e3)
            results.append({"requests": batch, "tokens_per_request": per, "ms": [round(t, 2) for t in times]})
            print(f"B={batch:3d} x {per:5d} tokens: first {times[0]:8.2f} ms, then {times[1]:7.2f} / {times[2]:7.2f}",
                  flush=True)
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            json.dump({"model": model, "shapes": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
