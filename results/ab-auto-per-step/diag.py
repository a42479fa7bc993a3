import sys
import time

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS
from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams

C = int(sys.argv[1])
e = Engine(EngineConfig("/work/main/engine/bundled/model", num_threads=2, cache=CacheConfig(max_resident_requests=16), spec=SpecConfig(draft_tokens="auto")))
prompts = [p for p in BUNDLED_PROMPTS if p.strip()]
times = {}
def run(tag, N=16, T=128):
    pending = [(i, prompts[i % len(prompts)]) for i in range(N)]; live = tokens = 0
    t = time.perf_counter()
    while pending or e.has_work:
        while pending and live < C:
            i, p = pending.pop(0); e.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=T, ignore_eos=True)); live += 1
        for ev in e.step():
            tokens += len(ev.token_ids); live -= ev.finish_reason is not None
        l = e.last_step
        if l is not None and not l.has_prefill:
            times.setdefault(l.num_head_forwards, []).append((l.seconds, l.num_head_rows))
    return tokens / (time.perf_counter() - t)
print(run("w"))
p = e.draft_policy
print("depths", dict(sorted(p.depths.items())), "coef us", [round(x*1e6) for x in p.estimator.coefficients()], "outliers", p.estimator.num_outliers, "replica alpha", round(p.replica_acceptance.value, 3))
import statistics

print({k: (len(v), round(statistics.median(s for s, _ in v)*1e3, 2), round(statistics.median(h for _, h in v), 1)) for k, v in sorted(times.items())})
coef = p.estimator.coefficients()
from mtpserve.engine.acceptance import expected_tokens
from mtpserve.engine.draft_policy import best_depth

a,b,c,h = coef
for al in (0.6, 0.7, 0.8, 0.9):
    vals = []
    for d in range(5):
        tok = expected_tokens(al, d); sec = a + b*(1+d) + c*d + h*(tok if d else 0)
        vals.append(round(tok/sec/1e3, 3))
    print(al, best_depth([al], [4], coef, 4, True), vals)
print("per-depth measured tokens/ms at alpha", round(p.replica_acceptance.value,2), {k: round(expected_tokens(p.replica_acceptance.value, k)/statistics.median(s for s, _ in v)/1e3, 3) for k, v in sorted(times.items())})
