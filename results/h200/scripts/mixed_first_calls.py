"""Which mixed steps (decode rows beside new prompts) pay a first-call cost, and in which phase.

    python3 mixed_first_calls.py MODEL_DIR OUT.json

One CUDA engine (K=0, graphs, warmed up as served, one ORT thread). Then three passes of one
pattern, each with requests of its own: for B in 1, 2, 4, 8, 16: B requests decode, then B new
prompts join them (a mixed step), and the next steps are timed and split by phase (the bench's
PhaseTimers). Pass 2 repeats pass 1's prompt lengths (the same shapes: a first-call cost is gone
there); pass 3 takes new lengths (new token counts at the same batch sizes: does the cost follow
the token count?). The CuPy kernel cache's files are counted around each pass (a kernel built).
Set CUDA_MODULE_LOADING=EAGER to see whether lazy loading of CUDA modules is the cost.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from mtpserve.engine.phase_timers import PhaseTimers
from mtpserve.engine.config import EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams


def cupy_files() -> int:
    d = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    return sum(1 for _ in d.rglob("*")) if d.exists() else 0


def main(model_dir: str, out: str) -> None:
    started = time.perf_counter()
    engine = Engine(EngineConfig(model_dir, device=os.environ.get("DEVICE", "cuda"), num_threads=1, spec=SpecConfig(0)))
    print(f"engine ready in {time.perf_counter() - started:.1f} s; CUDA_MODULE_LOADING="
          f"{os.environ.get('CUDA_MODULE_LOADING', '(default)')}", flush=True)
    timers = PhaseTimers(engine)
    vocab = engine.manifest.vocab_size
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    passes = []
    for p, seed in enumerate((1, 1, 2)):
        rng = np.random.default_rng(seed)
        files0, rows = cupy_files(), []
        for batch in (1, 2, 4, 8, 16):
            def prompt():
                return rng.integers(3, vocab, int(rng.integers(10, 180))).tolist()
            decoding = [f"p{p}-b{batch}-d{i}" for i in range(batch)]
            for rid in decoding:
                engine.add_request(rid, prompt(), params)
            for _ in range(6):                     # prompts in, then decoding
                engine.step()
            joining = [f"p{p}-b{batch}-j{i}" for i in range(batch)]
            lengths = []
            for rid in joining:
                ids = prompt()
                lengths.append(len(ids))
                engine.add_request(rid, ids, params)
            timers.reset()
            steps = []
            for _ in range(4):
                t0 = time.perf_counter()
                engine.step()
                ms = (time.perf_counter() - t0) * 1e3
                last = engine.last_step
                kind = "prefill" if last is not None and last.has_prefill else "decode"
                phases = timers.steps[kind][-1] if timers.steps[kind] else {}
                top = sorted(((k, v * 1e3) for k, v in phases.items() if k != "step"), key=lambda kv: -kv[1])[:4]
                steps.append({"ms": round(ms, 3), "prefill": kind == "prefill",
                              "top_phases_ms": {k: round(v, 3) for k, v in top}})
            for rid in decoding + joining:
                engine.abort(rid)
            while engine.has_work:
                engine.step()
            row = {"batch": batch, "joining_prompt_tokens": lengths, "steps": steps}
            rows.append(row)
            print(f"pass {p} B={batch:2d}: steps " + ", ".join(f"{s['ms']:.1f}" for s in steps)
                  + f" ms; slowest's phases {max(steps, key=lambda s: s['ms'])['top_phases_ms']}", flush=True)
        passes.append({"pass": p, "seed": seed, "cupy_files_built": cupy_files() - files0, "rows": rows})
        print(f"pass {p}: CuPy kernel cache files +{passes[-1]['cupy_files_built']}", flush=True)
    Path(out).write_text(json.dumps({"cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING"),
                                     "passes": passes}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
