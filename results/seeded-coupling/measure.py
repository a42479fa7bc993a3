"""Seeded (coupled) vs unseeded (rejection) sampled MTP on the bundled model, this CPU:
draft acceptance and tokens/s, 16 requests x 64 tokens at once, three rounds alternating.
python results/seeded-coupling/measure.py OUT.json"""
import json
import sys
import time

import numpy as np

sys.path.insert(0, "tests/engine")
from test_engine import PROMPTS, make_engine  # noqa: E402

from mtpserve.engine.bundled import MODEL_DIR  # noqa: E402
from mtpserve.engine.sampler import SamplingParams  # noqa: E402

rows = []
for setting in ({"temperature": 0.9, "top_p": 0.95}, {"temperature": 1.0}, {"temperature": 0.6}):
    for k in (2, 3):
        for rnd in range(3):
            for seeded in (True, False):
                e = make_engine(MODEL_DIR, k=k)
                for i in range(16):
                    sp = SamplingParams(max_tokens=64, ignore_eos=True, seed=i if seeded else None, **setting)
                    r = e.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], sp)
                    if not seeded:
                        r.rng = np.random.default_rng(1000 + i)     # fixed, so the run repeats
                started, n = time.perf_counter(), 0
                while e.has_work:
                    n += sum(len(ev.token_ids) for ev in e.step())
                rows.append({"setting": setting, "k": k, "round": rnd, "verify": "coupled" if seeded else "rejection",
                             "acceptance": e.stats.acceptance_rate, "tok_s": n / (time.perf_counter() - started)})
                print(rows[-1], flush=True)
json.dump({"runs": rows}, open(sys.argv[1], "w"), indent=1)
