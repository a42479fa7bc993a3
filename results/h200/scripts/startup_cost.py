"""What captured prompt steps add to an engine's start-up: one CUDA engine of MODEL_DIR built
with ``prompt_graphs`` on, then one with it off (K=0, the shipped defaults otherwise), each's
wall time to ready and every graph set's count, capture seconds and device memory.

    python3 startup_cost.py OUT.json MODEL_DIR
"""
from __future__ import annotations

import gc
import json
import sys
import time

from mtpserve.engine.config import EngineConfig
from mtpserve.engine.engine import Engine


def main() -> None:
    out, model = sys.argv[1], sys.argv[2]
    result = {"model": model}
    for prompt_graphs in (True, False):
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model, device="cuda", prompt_graphs=prompt_graphs))
        ready = time.perf_counter() - t0
        sets = {what: {"graphs": g.num_graphs, "capture_s": round(g.capture_seconds, 2),
                       "MiB": round(g.memory_bytes / 2**20, 1)} for what, g in engine.graph_sets().items()}
        row = {"ready_s": round(ready, 1), "sets": sets, "prompt_graphs_off": engine.prompt_graphs_off}
        result["on" if prompt_graphs else "off"] = row
        print("prompt graphs", "on" if prompt_graphs else "off", json.dumps(row), flush=True)
        del engine
        gc.collect()
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
