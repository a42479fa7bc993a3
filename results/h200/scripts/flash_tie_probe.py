"""Why greedy MTP on parted from MTP off at 256-token KV blocks (test_cuda, session 20: 1 of 8
requests), with the test's own workload: 8 prompts of ~350 tokens sharing ~340, 64 greedy tokens,
a 48-token step budget, CUDA graphs on.

For each block size and engine setting, runs K=0 and K=2 with logprobs=2 (each emitted token's
log-probability and the top two, from the logits the token was picked from: a decode row with
MTP off, a verify row with MTP on) and, per request that parts, reports the first parted position,
K=0's and K=2's top-two margin there (logprob of the first minus the second) and, over the
positions before it, the largest difference between the two runs' logprob of the same token (the
kernels' rounding gap). A part at a near tie (margin about the rounding gap) is rounding; a part
at a wide margin is a wrong token. Also checks that asking for logprobs left the tokens as they
are without them.

    python3 flash_tie_probe.py MODEL_DIR OUT.json [--block-sizes 256,16] [--device cuda]
"""
from __future__ import annotations

import argparse
import ast
import json
import time
from pathlib import Path

from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams


def test_prompts() -> list[str]:
    """test_engine.PROMPTS, read from the file (importing it needs pytest's conftest)."""
    src = (Path(__file__).resolve().parents[3] / "tests" / "engine" / "test_engine.py").read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PROMPTS":
            return ast.literal_eval(node.value)
    raise RuntimeError("PROMPTS not found in tests/engine/test_engine.py")


def engine_on(model_dir, device, k, block_size, prefix_cache=True, cuda_graphs=True) -> Engine:
    """test_cuda's engine_on."""
    return Engine(EngineConfig(str(model_dir), device=device,
                               cache=CacheConfig(num_blocks=512, max_resident_requests=32, prefix_cache=prefix_cache,
                                                 snapshot_interval=block_size, kv_block_size=block_size),
                               scheduler=SchedulerConfig(max_tokens_per_step=48, max_requests_per_step=32),
                               spec=SpecConfig(draft_tokens=k), cuda_graphs=cuda_graphs))


def run(engine, prompts, logprobs) -> dict:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=logprobs)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens, lps = {}, {}
    while engine.has_work:
        for ev in engine.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            lps.setdefault(ev.request_id, []).extend(ev.logprobs or [])
    engine.check_integrity()
    return {"tokens": tokens, "logprobs": lps}


def margin(entry) -> float | None:
    top = entry[2]
    return round(top[0][1] - top[1][1], 5) if len(top) >= 2 else None


def compare(off: dict, on: dict) -> dict:
    parts, gaps = [], []
    for rid, ref in off["tokens"].items():
        got = on["tokens"][rid]
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        upto = first if first is not None else len(ref)
        la, lb = off["logprobs"][rid], on["logprobs"][rid]
        gap = max((abs(la[i][1] - lb[i][1]) for i in range(upto)), default=0.0)
        gaps.append(gap)
        if first is not None:
            parts.append({"request": rid, "position": first, "off_token": ref[first], "on_token": got[first],
                          "off_top2": la[first][2], "on_top2": lb[first][2],
                          "off_margin": margin(la[first]), "on_margin": margin(lb[first]),
                          "gap_before": round(gap, 5)})
    return {"num_requests": len(off["tokens"]), "num_parted": len(parts), "parted": parts,
            "max_logprob_gap_before_parting": round(max(gaps), 5),
            "median_logprob_gap": round(sorted(gaps)[len(gaps) // 2], 5)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--block-sizes", default="256,16")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    shared = " ".join(test_prompts()) * 2
    prompts = [f"{shared} {q}" for q in test_prompts()[:8]]
    out = {"model": args.model_dir, "runs": {}}
    for b in map(int, args.block_sizes.split(",")):
        for label, kw in (("graphs, prefix cache", {}), ("graphs, no prefix cache", {"prefix_cache": False}),
                          ("eager, prefix cache", {"cuda_graphs": False})):
            t0 = time.perf_counter()
            runs = {k: run(engine_on(args.model_dir, args.device, k, b, **kw), prompts, 2) for k in (0, 2)}
            plain = run(engine_on(args.model_dir, args.device, 2, b, **kw), prompts, None)
            r = compare(runs[0], runs[2])
            r["logprobs_left_tokens_alone"] = plain["tokens"] == runs[2]["tokens"]
            r["seconds"] = round(time.perf_counter() - t0, 1)
            out["runs"][f"{b}: {label}"] = r
            print(f"block {b}, {label}: {r['num_parted']} of {r['num_requests']} parted; gap before parting max "
                  f"{r['max_logprob_gap_before_parting']} median {r['median_logprob_gap']}; logprobs left tokens "
                  f"alone: {r['logprobs_left_tokens_alone']}; {r['seconds']} s", flush=True)
            for q in r["parted"]:
                print(f"  {q['request']} at {q['position']}: off {q['off_token']} (margin {q['off_margin']}) "
                      f"on {q['on_token']} (margin {q['on_margin']}); off top2 {q['off_top2']} on top2 {q['on_top2']}",
                      flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
