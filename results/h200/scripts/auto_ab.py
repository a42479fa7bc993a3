"""K=0 against --draft-tokens auto (and an MTP engine that never drafts) at one load, without the
host's drift between runs: the bench's rounds build a new engine per run, and on the H200 host the
same K=0 run at C=16 took 0.49 to 0.82 ms a step from one round to the next (session as), as
large as the difference being measured. Here all engines live in one process and take turns,
many short runs each, the order rotated every round; each round's ratio is against the K=0 run
of that round.

    python3 auto_ab.py MODEL_DIR OUT.json [--concurrency 16] [--requests 64] [--rounds 12] [--freeze] [--fixed 2,3]
        [--synthetic 0.7 --random-prompts 128] [--bursts] [--table]

Each run also records its steps' p50 / p90 wall time and the garbage collector's passes during it
(their count and milliseconds, by generation); --freeze calls gc.freeze() once the engines are
built (what start-up leaves is then never scanned again by a full collection).

Each run: a closed loop of C requests in flight over the bundled prompts (greedy, 128 tokens),
N requests in all. Engines:
  K=0            MTP off
  auto           the adaptive policy (serve's default)
  never drafts   an MTP engine whose policy always answers 0: what keeping hidden rows and the
                 rest of an MTP engine's bookkeeping cost while it does not draft
  auto bursts    (--bursts) the adaptive policy exploring in bursts of 4 steps every 64 and
                 fitting only the steps that ran behind another (AdaptiveDraftPolicy's
                 explore_burst / fit_pipelined_only: not the default until measured here)
  auto table     (--table) the adaptive policy judging depths by a table of every batch size's
                 and depth's step time, timed at start-up (--draft-calibration on; the table
                 and its live drift are in each run's "fits")
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time

import numpy as np

from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS
from mtpserve.engine.config import EngineConfig, SpecConfig
from mtpserve.engine.draft_policy import AdaptiveDraftPolicy, FixedDraftPolicy
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams


class GcClock:
    """The collector's passes while it is on: count and ms by generation."""

    def __init__(self):
        self.ms, self.count, self._t = [0.0, 0.0, 0.0], [0, 0, 0], 0.0
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = info["generation"]
            self.ms[g] += (time.perf_counter() - self._t) * 1e3
            self.count[g] += 1

    def close(self) -> dict:
        gc.callbacks.remove(self)
        return {"count": self.count, "ms": [round(x, 2) for x in self.ms]}


def run(engine: Engine, prompts: list[list[int]], concurrency: int, tag: str) -> dict:
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    queue = list(enumerate(prompts))
    tokens = 0
    in_flight = set()
    times, pipelined = [], {"True": 0, "False": 0, "None": 0}
    clock = GcClock()
    t0 = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            i, p = queue.pop(0)
            engine.add_request(f"{tag}-{i}", p, params)
            in_flight.add(f"{tag}-{i}")
        s0 = time.perf_counter()
        for ev in engine.step():
            tokens += len(ev.token_ids)
            if ev.finish_reason is not None:
                in_flight.discard(ev.request_id)
        times.append(time.perf_counter() - s0)
        if engine.last_step is not None:
            pipelined[str(engine.last_step.pipelined)] += 1
    wall = time.perf_counter() - t0
    q = statistics.quantiles(times, n=10)
    return {"tokens": tokens, "steps": len(times), "seconds": round(wall, 4), "tok_s": round(tokens / wall, 1),
            "ms_per_step": round(wall / len(times) * 1e3, 4), "step_p50_ms": round(q[4] * 1e3, 4),
            "step_p90_ms": round(q[8] * 1e3, 4), "gc": clock.close(), "pipelined": pipelined,
            "fits": fits(engine.draft_policy)}


def device_memory(name: str, engine: Engine) -> None:
    """After an engine's build: the device's memory in use, and what its captures took."""
    try:
        import cupy
        free, total = cupy.cuda.runtime.memGetInfo()
    except Exception:                 # noqa: BLE001 - a CPU run: nothing to say
        return
    took = [f"{g.what} {g.memory_bytes / 2**30:.2f} GiB" for g in (engine.graphs,
            getattr(getattr(engine, "proposer", None), "graphs", None)) if g is not None]
    print(f"device memory after {name}: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use; "
          f"captures took {', '.join(took) or 'nothing'}", flush=True)


def fits(policy) -> dict:
    """An adaptive policy's step-cost fits by batch-size class (coefficients in ms), what it
    left out, and the depths it planned so far; {} for a fixed policy."""
    out = {}
    for c, f in sorted(getattr(policy, "fits", {}).items()):
        co = f.coefficients()
        out[str(c)] = {"coefficients_ms": None if co is None else [round(x * 1e3, 5) for x in co],
                       "steps": f.num_steps, "outliers": f.num_outliers, "alone": getattr(f, "num_alone", 0),
                       "deepest": f.deepest}
    table = getattr(policy, "cost_table", None)
    if table is not None:
        out["table"] = table.report()
    if out:
        out["depths"] = dict(sorted(getattr(policy, "depths", {}).items()))
    return out


def profile_pair(engines: dict, prompts: list, concurrency: int) -> list:
    import cProfile
    import pstats
    own, calls = {}, {}
    for name in ("auto", "never drafts"):
        pr = cProfile.Profile()
        pr.enable()
        r = run(engines[name], prompts, concurrency, f"prof-{name}")
        pr.disable()
        st = pstats.Stats(pr).stats
        key = [(f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}", v) for k, v in st.items()]
        own[name] = {k: v[2] / r["steps"] * 1e6 for k, v in key}
        calls[name] = {k: v[1] / r["steps"] for k, v in key}
        print(f"profiled {name}: {r['ms_per_step']:.3f} ms/step", flush=True)
    a, b = own["never drafts"], own["auto"]
    diff = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in set(a) | set(b)), reverse=True)
    print(f"own time per step, auto minus never drafts (us), total {sum(b.values()) - sum(a.values()):.1f}:")
    for d, k in diff[:25]:
        print(f"  {d:7.1f}  {k}  calls/step {calls['auto'].get(k, 0):.2f} vs {calls['never drafts'].get(k, 0):.2f}")
    return [(k, round(d, 2), round(calls["auto"].get(k, 0), 3)) for d, k in diff[:40]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--device", default="cuda")
    p.add_argument("--freeze", action="store_true")
    p.add_argument("--fixed", default="", help="fixed draft counts to run beside them, e.g. 2,3")
    p.add_argument("--synthetic", type=float, default=None, help="synthetic acceptance (an untrained head)")
    p.add_argument("--random-prompts", type=int, default=0, help="random prompts of this many tokens")
    p.add_argument("--bursts", action="store_true", help="also the adaptive policy exploring in bursts")
    p.add_argument("--table", action="store_true", help="also the adaptive policy on a timed step-cost table")
    p.add_argument("--no-never", action="store_true", help="leave out the engine that never drafts (on the 1.4 B "
                   "model four engines' captures do not fit one H200: session 18's bb ran out of memory building a fourth)")
    p.add_argument("--profile", action="store_true", help="after the rounds, cProfile one run of auto and of "
                   "the engine that never drafts: own time per step, auto minus it, largest first")
    args = p.parse_args()
    base = EngineConfig(args.model_dir, device=args.device)

    def spec(k):
        return SpecConfig(k, synthetic_acceptance=args.synthetic if k != 0 else None)
    engines = {"K=0": Engine(dataclasses.replace(base, spec=spec(0)))}
    device_memory("K=0", engines["K=0"])
    engines["auto"] = Engine(dataclasses.replace(base, spec=spec("auto")))
    device_memory("auto", engines["auto"])
    if not args.no_never:
        engines["never drafts"] = Engine(dataclasses.replace(base, spec=spec("auto")), draft_policy=FixedDraftPolicy(0))
    if args.bursts:
        policy = AdaptiveDraftPolicy(engines["auto"].max_drafts, explore_interval=64, explore_burst=4,
                                     fit_pipelined_only=True)
        engines["auto bursts"] = Engine(dataclasses.replace(base, spec=spec("auto")), draft_policy=policy)
    if args.table:
        t0 = time.perf_counter()
        engines["auto table"] = Engine(dataclasses.replace(base, spec=spec("auto")))
        t1 = time.perf_counter()
        table = engines["auto table"].calibrate_draft_costs()       # what --draft-calibration on runs at start
        device_memory("auto table", engines["auto table"])
        print(f"auto table: engine built in {t1 - t0:.1f} s, calibration {time.perf_counter() - t1:.2f} s; "
              "ms by batch size (rows) and depth:", table.report(), flush=True)
    for k in filter(None, args.fixed.split(",")):
        engines[f"K={k}"] = Engine(dataclasses.replace(base, spec=spec(int(k))))
        device_memory(f"K={k}", engines[f"K={k}"])
    e0 = engines["K=0"]
    if args.random_prompts:
        rng = np.random.default_rng(0)
        prompts = rng.integers(3, e0.manifest.vocab_size, (args.requests, args.random_prompts)).tolist()
    else:
        texts = [e0.tokenizer.encode(t) for t in BUNDLED_PROMPTS]
        prompts = [texts[i % len(texts)] for i in range(args.requests)]
    names = list(engines)
    for name, e in engines.items():          # one run each first: prefix caches filled alike
        run(e, prompts, args.concurrency, f"warm-{name}")
    if args.freeze:
        gc.collect()
        gc.freeze()
    rounds = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        rec = {}
        for name in order:
            e = engines[name]
            before = dataclasses.asdict(e.scheduler.stats)
            rec[name] = run(e, prompts, args.concurrency, f"r{r}-{name}")
            after = dataclasses.asdict(e.scheduler.stats)
            rec[name]["spec"] = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
        for name in names[1:]:
            rec[name]["vs_k0"] = round(rec[name]["tok_s"] / rec["K=0"]["tok_s"], 4)
        rounds.append({"order": order, **rec})
        print(f"round {r}: " + "  ".join(f"{n} {rec[n]['tok_s']:.0f} tok/s {rec[n]['ms_per_step']:.3f} ms/step "
                                         f"(p50 {rec[n]['step_p50_ms']:.3f} p90 {rec[n]['step_p90_ms']:.3f}, "
                                         f"gc {rec[n]['gc']['count']} {sum(rec[n]['gc']['ms']):.1f} ms)"
                                         + (f" ({rec[n]['vs_k0']:.3f}x)" if n != "K=0" else "") for n in names),
              flush=True)
        save(args, rounds, {})                  # each round kept: a run cut by its timeout still says something
    summary = {n: {"median_vs_k0": statistics.median(r[n]["vs_k0"] for r in rounds),
                   "ratios": [r[n]["vs_k0"] for r in rounds]} for n in names[1:]}
    for n, s in summary.items():
        print(f"{n}: median {s['median_vs_k0']:.3f}x K=0 over {args.rounds} rounds "
              f"(min {min(s['ratios']):.3f}, max {max(s['ratios']):.3f})", flush=True)
    if args.profile:
        summary["profile_auto_minus_never_us"] = profile_pair(engines, prompts, args.concurrency)
    fixed = [n for n in names if n.startswith("K=")]
    if len(fixed) > 1:
        for name in [n for n in names if n.startswith("auto")]:
            vs_best = [r[name]["tok_s"] / max(r[n]["tok_s"] for n in fixed) for r in rounds]
            summary[f"{name}_vs_best_fixed"] = {"median": statistics.median(vs_best), "ratios": [round(x, 4) for x in vs_best]}
            print(f"{name}: median {statistics.median(vs_best):.3f}x the round's best fixed K ({', '.join(fixed)})", flush=True)
    save(args, rounds, summary)


def save(args, rounds: list, summary: dict) -> None:
    with open(args.out, "w") as f:
        json.dump({"model": args.model_dir, "concurrency": args.concurrency, "requests": args.requests,
                   "freeze": args.freeze, "rounds": rounds, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
