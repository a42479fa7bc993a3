"""How much device memory an MTP engine's CUDA graph captures take, by capture order and ORT
arena growth: one engine built per process, its captures' bytes printed and saved.

Session 18: the 1.4 B model's MTP engine took 15.0 GiB (main model) + 14.5 GiB (head) of captures,
captured in growing order, against 0.26 GiB for a K=0 engine. ORT's PagedAttention without flash
kernels for 16-token blocks gathers each request's KV bucket into dense K and V per multi-token
step (2.5 GiB for the largest verify shapes), and ORT's BFC arena grows in power-of-two regions it
never merges. The engine now captures largest first (GraphCatalog.capture_order).

    python3 graph_memory_probe.py MODEL_DIR OUT.json --order largest|growing --arena next-power|same [--kv-block-size 64]

--order growing: the order before session 18 (GraphCatalog.shapes()); --arena same: ORT's
arena_extend_strategy kSameAsRequested (each region the size asked for, not the next power of
two) on the engine's CUDA sessions.
"""
from __future__ import annotations

import argparse
import json
import time

import onnxruntime as ort

from mtpserve.engine import cuda_graphs
from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--order", choices=("largest", "growing"), default="largest")
    p.add_argument("--arena", choices=("next-power", "same"), default="next-power")
    p.add_argument("--draft-tokens", default="auto")
    p.add_argument("--kv-block-size", type=int, help="serve the export with KV blocks of this many tokens")
    args = p.parse_args()
    if args.order == "growing":
        cuda_graphs.GraphCatalog.capture_order = cuda_graphs.GraphCatalog.shapes
    if args.arena == "same":
        session = ort.InferenceSession

        def with_strategy(path, so=None, providers=None, **kw):
            pairs = [x if isinstance(x, tuple) else (x, {}) for x in providers or []]
            providers = [(n, {**o, "arena_extend_strategy": "kSameAsRequested"} if n == "CUDAExecutionProvider" else o)
                         for n, o in pairs]
            return session(path, so, providers=providers, **kw)
        ort.InferenceSession = with_strategy
    import cupy
    free0, total = cupy.cuda.runtime.memGetInfo()
    t0 = time.perf_counter()
    k = args.draft_tokens
    engine = Engine(EngineConfig(args.model_dir, device="cuda", spec=SpecConfig(k if k == "auto" else int(k)),
                                 cache=CacheConfig(kv_block_size=args.kv_block_size)))
    free1, _ = cupy.cuda.runtime.memGetInfo()
    graphs = {"main model": engine.graphs}
    if engine.proposer is not None:
        graphs["MTP head"] = engine.proposer.graphs
    out = {"order": args.order, "arena": args.arena, "draft_tokens": k, "block_size": engine.manifest.block_size, "build_s": round(time.perf_counter() - t0, 1),
           "device_gib_in_use": round((total - free1) / 2**30, 2), "engine_gib": round((free0 - free1) / 2**30, 2),
           "captures_gib": {n: round(g.memory_bytes / 2**30, 3) for n, g in graphs.items() if g is not None},
           "shapes": {n: len(g.catalog.shapes()) for n, g in graphs.items() if g is not None}}
    print(json.dumps(out), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
