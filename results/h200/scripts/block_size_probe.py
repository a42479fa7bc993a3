"""What the paged KV block size changes on the device, for one export: MTP on against off (greedy,
real acceptance, CUDA graphs on), their tokens compared request by request, each engine's capture
memory and time a step, and the kernel ORT's PagedAttention picks (with
ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1 in the environment ORT prints it per node: grep the log).

ORT's PagedAttention reads KV pages in place with its flash kernel only when the block size is a
multiple of 256 / 128 / 64 tokens for head sizes up to 64 / 128 / 256 (a reading of its source,
results/h200/README.md "Nineteenth session"); with 16-token blocks a multi-token step (a prompt,
an MTP verify) gathers each request's KV into dense K and V, which is what made the 1.4 B model's
MTP captures take ~30 GiB (session 18). Run on the same export at 16 and at 64 tokens
(`--kv-block-size 64`: the builder's graphs read the block size from the pools) and compare.

A random-weight model's head drafts badly, so nearly every draft is rejected: each verify's first
row (computed by the multi-token kernel) then gives the emitted token that a decode row (the
one-token kernel) gives with MTP off. Tokens that differ are the two kernels' rounding on near
ties, on either block size; the counts side by side say whether flash changes that.

    python3 block_size_probe.py MODEL_DIR OUT.json [--concurrency 8] [--requests 16] [--prompt-len 96] [--max-tokens 48]
        [--draft-tokens 2] [--device cuda] [--kv-block-size 64]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from auto_ab import ClosedLoop  # this folder's closed loop (run as a script: its folder is on the path)

from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--draft-tokens", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no memory figures)")
    p.add_argument("--kv-block-size", type=int, help="serve the export with KV blocks of this many tokens")
    args = p.parse_args()

    def free_bytes() -> tuple[int, int]:
        if args.device != "cuda":
            return 0, 0
        import cupy
        return cupy.cuda.runtime.memGetInfo()
    out = {"model": args.model_dir, "engines": {}}
    results = {}
    for k in (0, args.draft_tokens):
        free0, _ = free_bytes()
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(args.model_dir, device=args.device, spec=SpecConfig(k),
                                     cache=CacheConfig(kv_block_size=args.kv_block_size)))
        build = time.perf_counter() - t0
        free1, _ = free_bytes()
        if k == 0:
            out["block_size"] = engine.manifest.block_size
            rng = np.random.default_rng(0)
            prompts = rng.integers(3, engine.manifest.vocab_size - 3, (args.requests, args.prompt_len)).tolist()
        ClosedLoop(engine, prompts[:2], 2, "warm", max_tokens=4).advance()     # first calls out of the timed run
        before = (engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens)     # (the counters accumulate)
        loop = ClosedLoop(engine, prompts, args.concurrency, "p", args.max_tokens, keep_outputs=True)
        loop.advance()
        tokens, seconds, steps = loop.outputs, loop.seconds, len(loop.times)
        graphs = {"main": engine.graphs, "head": getattr(engine.proposer, "graphs", None)}
        s = engine.stats
        out["engines"][f"K={k}"] = {
            "build_s": round(build, 1), "engine_gib": round((free0 - free1) / 2**30, 2),
            "captures_gib": {n: round(g.memory_bytes / 2**30, 3) for n, g in graphs.items() if g is not None},
            "seconds": round(seconds, 3), "steps": steps, "ms_per_step": round(seconds / steps * 1e3, 3),
            "tok_s": round(sum(map(len, tokens.values())) / seconds, 1),
            "drafted": s.num_draft_tokens - before[0], "accepted": s.num_accepted_tokens - before[1]}
        results[k] = tokens
        print(f"K={k}: {json.dumps(out['engines'][f'K={k}'])}", flush=True)
        del engine
    off, on = results[0], results[args.draft_tokens]
    differ = {rid: next(i for i, (a, b) in enumerate(zip(off[rid], on[rid])) if a != b)
              for rid in off if off[rid] != on[rid]}
    out["requests"], out["identical"] = len(off), len(off) - len(differ)
    out["first_difference_at"] = differ
    print(f"block size {out['block_size']}: MTP K={args.draft_tokens} on == off for {out['identical']} of "
          f"{out['requests']} requests; first differing token of the others: {differ}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
