"""Which CuPy kernels a live step still builds (NVRTC) after the engine's start-up, and where.

    CUPY_CACHE_DIR=$(mktemp -d) python3 live_compiles.py MODEL_DIR OUT.json

Session 23's step_costs.py profile (H100) caught 3 NVRTC builds, 0.32 s, in its K=2 loop at 16
requests, after the engine's warm-up and earlier loops at K=0 / 2, B=1 and K=0, B=16. With a
fresh kernel cache (a new machine) every kernel CuPy has not built in this process is compiled
on its first use. This builds the engine as ``mtpserve serve`` does (bundled model, CUDA, MTP),
then hooks NVRTC and runs closed loops a server sees: greedy K=2 and auto at 1 and 16 requests
(synthetic acceptance 0.8 beside the real one), sampled requests, requests sharing a prefix
(prefix hits, snapshots with pending head rows), and step_costs.py's loops. Every build is
printed with its kernel's name, its seconds and the engine frames that asked for it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from auto_ab import ClosedLoop  # noqa: E402

BUILDS: list[dict] = []
PHASE = ["start-up"]


def hook_nvrtc() -> None:
    """Wrap CuPy's NVRTC program compile: each call recorded with the phase, the kernel names
    in its source, its seconds and the mtpserve frames of its stack."""
    from cupy.cuda import compiler
    original = compiler._NVRTCProgram.compile

    def compile(self, *a, **k):
        t = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            src = getattr(self, "src", b"")
            src = src.decode(errors="replace") if isinstance(src, bytes) else str(src)
            names = re.findall(r"__global__\s+void\s+(\w+)", src)[:4]
            frames = [f"{f.filename.split('mtpserve/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                      if "mtpserve" in f.filename][-8:]
            BUILDS.append({"phase": PHASE[0], "kernels": names, "seconds": round(time.perf_counter() - t, 3),
                           "frames": frames})
            if PHASE[0] != "start-up":
                print(f"  BUILD in {PHASE[0]}: {names} {BUILDS[-1]['seconds']} s\n    " + "\n    ".join(frames),
                      flush=True)
    compiler._NVRTCProgram.compile = compile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the phases (no NVRTC there)")
    a = ap.parse_args()
    if a.device == "cuda":
        hook_nvrtc()
    from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, text_workload
    from mtpserve.engine.config import EngineConfig, SpecConfig
    from mtpserve.engine.draft_policy import FixedDraftPolicy
    from mtpserve.engine.engine import Engine
    from mtpserve.engine.sampler import SamplingParams

    t0 = time.perf_counter()
    engine = Engine(EngineConfig(a.model_dir, device=a.device, spec=SpecConfig("auto")))
    print(f"engine built in {time.perf_counter() - t0:.1f} s; {len(BUILDS)} NVRTC builds at start-up "
          f"({sum(b['seconds'] for b in BUILDS):.2f} s)", flush=True)
    tok = engine.tokenizer.encode
    prompts = text_workload(BUNDLED_PROMPTS, tok, 64).prompt_ids
    shared = tok(" ".join(BUNDLED_PROMPTS[:6]))            # a long shared prefix: hits and snapshots
    prefixed = [shared + p for p in prompts[:32]]
    rng = np.random.default_rng(0)
    randoms = rng.integers(3, engine.manifest.vocab_size, (48, 128)).tolist()
    greedy = [SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)]
    mixed = greedy + [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=96, ignore_eos=True),
                      SamplingParams(temperature=0.7, seed=3, max_tokens=96, ignore_eos=True)]
    auto = engine.draft_policy
    phases = [("K=2 greedy C=1", FixedDraftPolicy(2), prompts[:4], 1, greedy),
              ("K=2 greedy C=16", FixedDraftPolicy(2), prompts, 16, greedy),
              ("auto greedy C=16", auto, prompts, 16, greedy),
              ("auto mixed C=16", auto, prompts, 16, mixed),
              ("K=2 prefix hits C=16", FixedDraftPolicy(2), prefixed, 16, greedy),
              ("K=0 random C=16", FixedDraftPolicy(0), randoms, 16, greedy),
              ("K=2 random C=16", FixedDraftPolicy(2), randoms, 16, greedy),
              ("K=3 mixed C=8", FixedDraftPolicy(3), prompts[:32], 8, mixed)]
    result = []
    for name, policy, ps, c, params in phases:
        PHASE[0] = name
        engine.draft_policy = engine.scheduler.draft_policy = policy
        n = len(BUILDS)
        t = time.perf_counter()
        loop = ClosedLoop(engine, ps, c, name.replace(" ", "-"), params=params)
        loop.advance()
        steps = len(loop.times)
        builds = BUILDS[n:]
        print(f"{name}: {steps} steps in {time.perf_counter() - t:.2f} s, {len(builds)} builds "
              f"({sum(b['seconds'] for b in builds):.2f} s)", flush=True)
        result.append({"phase": name, "steps": steps, "builds": builds})
    engine.check_integrity()
    json.dump({"start_up_builds": [b for b in BUILDS if b["phase"] == "start-up"], "phases": result},
              open(a.out, "w"), indent=1)
    live = [b for b in BUILDS if b["phase"] != "start-up"]
    print(f"live builds: {len(live)} ({sum(b['seconds'] for b in live):.2f} s)", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
