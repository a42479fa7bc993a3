"""Where a seeded request's tokens part between MTP on (K=2, verify steps) and MTP off (decode
steps) on the device, and why: for every seeded draw the target makes, the two best entries of
its exponential race (p(v) / E_v) are recorded, so the first position where two runs part shows
whether the race there was a near-tie (fp16 rounding of two differently shaped forwards) or not
(a logic error: a wrong position, seed or distribution).

    python3 diag.py [MODEL_DIR]   (the bundled model by default; needs the GPU path)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

root = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(root / "tests" / "engine"))

from mtpserve.engine import sampler, speculative  # noqa: E402
from mtpserve.engine.bundled import MODEL_DIR  # noqa: E402
from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from mtpserve.engine.engine import Engine  # noqa: E402
from mtpserve.engine.sampler import SamplingParams  # noqa: E402
from test_engine import PROMPTS, run_all  # noqa: E402

RECORD: dict[tuple[int, int], tuple] = {}
_draw = speculative.draw_tokens


def recording_draw(probs_rows, requests, offsets, xp=None):
    out = _draw(probs_rows, requests, offsets, xp)
    xp = xp or np
    for i, r in enumerate(requests):
        if not r.params.is_seeded_sampled:
            continue
        pos = r.num_output_tokens + offsets[i]
        p = sampler.to_host(xp.asarray(probs_rows[i]).astype(xp.float64))
        e = sampler.to_host(sampler.position_noise([r.params.seed], [pos], p.shape[0], xp))[0]
        with np.errstate(divide="ignore"):
            score = np.log(p) - np.log(e)
        top = np.argsort(-score)[:2]
        RECORD[(r.params.seed, pos)] = (int(top[0]), int(top[1]), float(score[top[0]] - score[top[1]]),
                                        float(p[top[0]]), float(p[top[1]]), int(out[i]))
    return out


speculative.draw_tokens = recording_draw


def engine_on(model_dir, k):
    return Engine(EngineConfig(str(model_dir), device=os.environ.get("DIAG_DEVICE", "cuda"),
                               cache=CacheConfig(num_blocks=512, max_resident_requests=32, snapshot_interval=16),
                               scheduler=SchedulerConfig(max_tokens_per_step=48, max_requests_per_step=32),
                               spec=SpecConfig(draft_tokens=k), cuda_graphs=True))


def run(model_dir, k, rounds=1):
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    engine = engine_on(model_dir, k)
    outs = []
    for _ in range(rounds):
        RECORD.clear()
        tokens, _ = run_all(engine, PROMPTS, params)
        outs.append((tokens, dict(RECORD)))
    return outs


def main() -> None:
    model_dir = sys.argv[1] if len(sys.argv) > 1 else MODEL_DIR
    (plain, rec0), = run(model_dir, 0)
    report = {"sequences": len(plain), "runs": {}}
    for name, (tokens, rec) in zip(["K2 first", "K2 again"], run(model_dir, 2, rounds=2)):
        parted, log_p_diffs = [], []
        for i, rid in enumerate(sorted(plain, key=lambda s: int(s[1:]))):
            seed = 100 + int(rid[1:])
            a, b = tokens[rid], plain[rid]
            j = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), None)
            for n in range(len(a) if j is None else j):
                ra, rb = rec.get((seed, n)), rec0.get((seed, n))
                if ra and rb and ra[0] == rb[0]:
                    log_p_diffs.append(abs(np.log(ra[3]) - np.log(rb[3])))
            if j is not None:
                parted.append({"request": rid, "position": j, "mtp_on": rec.get((seed, j)), "mtp_off": rec0.get((seed, j))})
        report["runs"][name] = {
            "parted": parted,
            "log_p_of_the_drawn_token_on_vs_off": {"max": float(np.max(log_p_diffs)), "median": float(np.median(log_p_diffs)),
                                                   "n": len(log_p_diffs)},
        }
    text = json.dumps(report, indent=1)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "seeded-numerics.json").write_text(text)


if __name__ == "__main__":
    main()
