"""Where an MTP engine's steps without drafts lose to a K=0 engine's (``--draft-tokens auto`` at a
load where no depth pays), on the host: the same closed loop of B requests in a K=0 engine and in
an auto engine, cProfile of the step loop, each function's own time per step in both, and the
differences, largest first; each loop's wall time per step unprofiled, before and after.

    python3 auto_k0_profile.py MODEL_DIR OUT.json [--batch 16] [--steps 600] [--device cuda]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import numpy as np

from mtpserve.engine.config import EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams


def loop(engine: Engine, batch: int, steps: int, profile: bool) -> dict:
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 200, ignore_eos=True)
    ids = [f"p{profile}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rng.integers(3, engine.manifest.vocab_size, 60).tolist(), params)
    for _ in range(60):                        # prompts in, the policy settled
        engine.step()
    pr = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if pr:
        pr.enable()
    for _ in range(steps):
        engine.step()
    if pr:
        pr.disable()
    wall = (time.perf_counter() - t0) / steps * 1e3
    for rid in ids:
        engine.abort(rid)
    while engine.has_work:
        engine.step()
    out = {"wall_ms_per_step": round(wall, 4), "depths": dict(getattr(engine.draft_policy, "depths", {}))}
    if pr:
        stats = pstats.Stats(pr).stats
        out["own_us_per_step"] = {f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}": v[2] / steps * 1e6 for k, v in stats.items()}
        out["calls_per_step"] = {f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}": v[1] / steps for k, v in stats.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    result = {}
    for name, spec in (("K=0", SpecConfig(0)), ("auto", SpecConfig("auto"))):
        engine = Engine(EngineConfig(args.model_dir, device=args.device, num_threads=1, spec=spec))
        plain = loop(engine, args.batch, args.steps, False)
        profiled = loop(engine, args.batch, args.steps, True)
        plain2 = loop(engine, args.batch, args.steps, False)
        result[name] = {"wall_ms_per_step": [plain["wall_ms_per_step"], plain2["wall_ms_per_step"]],
                        "profiled_ms_per_step": profiled["wall_ms_per_step"], "depths": plain2["depths"],
                        "own_us_per_step": profiled["own_us_per_step"], "calls_per_step": profiled["calls_per_step"]}
        print(f"{name}: {result[name]['wall_ms_per_step']} ms/step unprofiled, {profiled['wall_ms_per_step']} profiled, "
              f"depths {plain2['depths']}", flush=True)
        del engine
    a, b = result["K=0"]["own_us_per_step"], result["auto"]["own_us_per_step"]
    diff = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in set(a) | set(b)), reverse=True)
    result["auto_minus_k0_us"] = [(k, round(d, 2)) for d, k in diff[:30]]
    print("own time per step, auto minus K=0 (us):")
    for d, k in diff[:22]:
        print(f"  {d:8.2f}  {k}  (calls/step {result['auto']['calls_per_step'].get(k, 0):.1f})")
    print(f"  total {sum(b.values()) - sum(a.values()):.1f} us")
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
