"""Interleaved A/B of draft policies in one process: rounds of (K=0, K=1, K=2, auto), each a closed
loop of N prompts at concurrency C; prints per-round tok/s and the median ratio auto / best fixed."""
import json, statistics, sys, time
from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams
from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS

C, N, R, T = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = "/work/main/engine/bundled/model"
ks = [int(k) if k != "auto" else k for k in (sys.argv[5] if len(sys.argv) > 5 else "0,1,2,auto").split(",")]
engines = {k: Engine(EngineConfig(model, num_threads=2, cache=CacheConfig(max_resident_requests=16),
                                  spec=SpecConfig(draft_tokens=k))) for k in ks}
prompts = [p for p in BUNDLED_PROMPTS if p.strip()]


def run(e, tag):
    pending = [(i, prompts[i % len(prompts)]) for i in range(N)]
    live = tokens = 0
    t = time.perf_counter()
    while pending or e.has_work:
        while pending and live < C:
            i, p = pending.pop(0)
            e.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=T, ignore_eos=True))
            live += 1
        for ev in e.step():
            tokens += len(ev.token_ids)
            if ev.finish_reason is not None:
                live -= 1
    return tokens / (time.perf_counter() - t)


for k in ks:
    run(engines[k], f"w{k}")
rows = []
for r in range(R):
    order = ks[r % len(ks):] + ks[:r % len(ks)]
    row = {k: run(engines[k], f"r{r}{k}") for k in order}
    rows.append(row)
    print(json.dumps({str(k): round(v, 1) for k, v in row.items()}), flush=True)
ratio_best = statistics.median(row["auto"] / max(row[k] for k in ks if k != "auto") for row in rows)
ratio_k0 = statistics.median(row["auto"] / row[0] for row in rows)
fixed = {k: statistics.median(row[k] / row[0] for row in rows) for k in ks}
print(f"C={C}: median per round: auto/best-fixed {ratio_best:.3f}, auto/K0 {ratio_k0:.3f}; vs K0: {fixed}")
