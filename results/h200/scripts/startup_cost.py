"""What captured prompt steps add to an engine's start-up, and which of their shapes the memory
goes to: one CUDA engine of MODEL_DIR built with ``prompt_graphs`` on, then (``--also-off``) one
with it off (K=0 unless ``--draft-tokens``, the shipped defaults otherwise); each's wall time to
ready, every graph set's count, capture seconds and device memory, and the prompt set's memory
by shape (``_GraphSet.memory_by_shape``: the free memory each capture took, in capture order,
largest shapes first), with its totals by total rows, by KV bucket and by batch.

    python3 startup_cost.py OUT.json MODEL_DIR [--also-off] [--draft-tokens K]

Session 37 (1.4 B model, H100, before the by-shape counts): on, 484 prompt graphs in 41.4 s,
17,164 MiB, ready in 58.4 s; off, ready in 11.0 s.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict

from mtpserve.engine.config import EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine

MIB = 2 ** 20


def by_shape(graphs, block_size: int) -> dict:
    shapes = [{"batch": s.batch, "rows": s.tokens, "kv_tokens": s.table_width * block_size, "bank": s.bank,
               "MiB": round(b / MIB, 2)} for s, b in graphs.memory_by_shape.items()]
    totals = {}
    for key in ("rows", "kv_tokens", "batch"):
        sums = defaultdict(float)
        for s in shapes:
            sums[s[key]] += s["MiB"]
        totals[key] = {k: round(v, 1) for k, v in sorted(sums.items())}
    return {"totals_MiB": totals, "shapes": shapes}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("model_dir")
    p.add_argument("--also-off", action="store_true", help="then an engine without prompt graphs")
    p.add_argument("--draft-tokens", type=int, default=0)
    a = p.parse_args()
    result = {"model": a.model_dir, "draft_tokens": a.draft_tokens}
    for prompt_graphs in (True, False) if a.also_off else (True,):
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(a.model_dir, device="cuda", spec=SpecConfig(a.draft_tokens),
                                     prompt_graphs=prompt_graphs))
        ready = time.perf_counter() - t0
        sets = {what: {"graphs": g.num_graphs, "capture_s": round(g.capture_seconds, 2),
                       "MiB": round(g.memory_bytes / MIB, 1)} for what, g in engine.graph_sets().items()}
        row = {"ready_s": round(ready, 1), "sets": sets, "prompt_graphs_off": engine.prompt_graphs_off}
        print("prompt graphs", "on" if prompt_graphs else "off", json.dumps(row), flush=True)
        if engine.prompt_graphs is not None:
            row["prompt_by_shape"] = by_shape(engine.prompt_graphs, engine.manifest.block_size)
            print("prompt graphs' MiB by", json.dumps(row["prompt_by_shape"]["totals_MiB"]), flush=True)
        result["on" if prompt_graphs else "off"] = row
        del engine
        gc.collect()
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
