import time, statistics, cProfile, pstats, io
from mtpserve.engine.config import CacheConfig, EngineConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.draft_policy import FixedDraftPolicy
from mtpserve.engine.sampler import SamplingParams
from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS
M = "/work/main/engine/bundled/model"
a = Engine(EngineConfig(M, num_threads=2, cache=CacheConfig(max_resident_requests=16), spec=SpecConfig(draft_tokens=0)))
b = Engine(EngineConfig(M, num_threads=2, cache=CacheConfig(max_resident_requests=16), spec=SpecConfig(draft_tokens="auto")), FixedDraftPolicy(0))
prompts = [p for p in BUNDLED_PROMPTS if p.strip()]
def run(e, tag, N=32, C=16, T=128, prof=None):
    pending = [(i, prompts[i % len(prompts)]) for i in range(N)]; live = tokens = 0
    t = time.perf_counter()
    if prof: prof.enable()
    while pending or e.has_work:
        while pending and live < C:
            i, p = pending.pop(0); e.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=T, ignore_eos=True)); live += 1
        for ev in e.step():
            tokens += len(ev.token_ids); live -= ev.finish_reason is not None
    if prof: prof.disable()
    return tokens / (time.perf_counter() - t)
run(a, "w"); run(b, "w")
ra, rb = [], []
for r in range(4):
    ra.append(run(a, f"a{r}")); rb.append(run(b, f"b{r}"))
print("K0 engine", [round(x) for x in ra], "MTP engine at K=0", [round(x) for x in rb], "ratio", round(statistics.median(y/x for x, y in zip(ra, rb)), 3))
for e, name in ((a, "K0"), (b, "MTP@0")):
    pr = cProfile.Profile(); run(e, "p" + name, prof=pr)
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12); print(name, s.getvalue()[:2500])
