"""Why greedy MTP on parted from MTP off at 256-token KV blocks (test_cuda, session 20: 1 of 8
requests), with the test's own workload and engines (test_cuda's SHARED_PREFIX_PROMPTS, engine_on
and _greedy_run: 8 prompts of ~350 tokens sharing ~340, 64 greedy tokens, a 48-token step budget).

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
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "engine"))
from mtpserve.engine.sampler import SamplingParams  # noqa: E402

from test_cuda import SHARED_PREFIX_PROMPTS, _greedy_run, engine_on  # noqa: E402 - test_cuda's workload and engines


def run(engine, logprobs) -> dict:
    """test_cuda's workload on ``engine``, greedy, 64 tokens, logprobs=``logprobs``."""
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=logprobs)]
    tokens, _, tops = _greedy_run(engine, params * len(SHARED_PREFIX_PROMPTS), SHARED_PREFIX_PROMPTS)
    return {"tokens": tokens, "logprobs": tops}


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
    out = {"model": args.model_dir, "runs": {}}
    for b in map(int, args.block_sizes.split(",")):
        for label, kw in (("graphs, prefix cache", {}), ("graphs, no prefix cache", {"prefix_cache": False}),
                          ("eager, prefix cache", {"cuda_graphs": False})):
            t0 = time.perf_counter()
            runs = {k: run(engine_on(args.model_dir, args.device, k, budget=48, block_size=b, **kw), 2) for k in (0, 2)}
            plain = run(engine_on(args.model_dir, args.device, 2, budget=48, block_size=b, **kw), None)
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
