"""K=0 against --draft-tokens auto (and an MTP engine that never drafts) at one load, without the
host's drift between runs: the bench's rounds build a new engine per run, and on the H200 host the
same K=0 run at C=16 took 0.49 to 0.82 ms a step from one round to the next (session as), as
large as the difference being measured. Here all engines live in one process and take turns,
many short runs each, the order rotated every round; each round's ratio is against the K=0 run
of that round.

    python3 auto_ab.py MODEL_DIR OUT.json [--interleave 64] [--concurrency 16] [--requests 64] [--rounds 12] [--freeze] [--fixed 2,3]
        [--synthetic 0.7 --random-prompts 128] [--bursts] [--table] [--range-ratio 0.5]

--interleave N runs the engines at once instead, each taking turns of N steps (the order rotated
each cycle), so that every engine sees the same host: at C=16 the same engine's runs took 0.54
or 1.0 ms a step (p50) from one round to the next (session 17, both modes in every engine), and
8 rounds could not tell 3% apart. Its rounds' ratios are of whole runs as before (each engine's
time the sum of its turns); "turn_ratios" keeps each cycle's ratio to K=0 besides.

Each run also records its steps' p50 / p90 wall time and the garbage collector's passes during it
(their count and milliseconds, by generation); --freeze calls gc.freeze() once the engines are
built (what start-up leaves is then never scanned again by a full collection).

Each run: a closed loop of C requests in flight over the bundled prompts (greedy, 128 tokens,
or with --range-ratio R lengths drawn from 128 x [1 - R, 1 + R], the same for every engine), N
requests in all. Engines:
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
import functools
import gc
import json
import statistics
import time

import numpy as np

from mtpserve.cluster.bench.engine_driver import CollectionLog
from mtpserve.cluster.bench.workload import BUNDLED_PROMPTS, output_lengths, text_workload
from mtpserve.engine.config import EngineConfig, SpecConfig
from mtpserve.engine.draft_policy import MAX_NUM_DRAFTS, AdaptiveDraftPolicy, FixedDraftPolicy
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams


def gc_by_generation(log: CollectionLog) -> dict:
    """The collector's passes a ``CollectionLog`` saw: count and ms by generation (0, 1, 2)."""
    by = log.summary()
    return {"count": [by.get(str(g), {}).get("count", 0) for g in range(3)],
            "ms": [round(by.get(str(g), {}).get("ms", 0.0), 2) for g in range(3)]}


class ForwardClock:
    """Wall time inside ONNX Runtime's run calls (every session's), patched in at the class: on
    the CPU a forward runs in the call, so a step's wall time less this is its host time (what
    an engine's Python costs a step; on the GPU, where a replay returns before its kernels
    finish, it is the host's launch time and waits instead)."""
    seconds = 0.0

    @classmethod
    def install(cls) -> None:
        import onnxruntime as ort
        for name in ("run", "run_with_iobinding"):
            method = getattr(ort.InferenceSession, name)

            def timed(*a, _m=method, **k):
                t = time.perf_counter()
                try:
                    return _m(*a, **k)
                finally:
                    cls.seconds += time.perf_counter() - t
            setattr(ort.InferenceSession, name, timed)


class ClosedLoop:
    """C requests of ``prompts`` in flight on one engine (greedy, ``max_tokens`` each), a finished
    one replaced at once, stepped ``advance(n)`` steps at a time: one engine's run, or its turns
    in an interleaved one. ``max_tokens``: one length for all, or request i's (``workload.output_lengths``).
    ``outputs``: each request's tokens, when ``keep_outputs``. ``on_step(loop)``: called after each
    step (``step_trace.py`` records it). ``params``: request i's sampling is ``params[i % len]``
    instead (``max_tokens`` is then theirs)."""

    def __init__(self, engine: Engine, prompts: list[list[int]], concurrency: int, tag: str,
                 max_tokens: int | list[int] = 128, keep_outputs: bool = False, on_step=None,
                 params: list[SamplingParams] | None = None):
        self.engine, self.concurrency, self.tag, self.on_step = engine, concurrency, tag, on_step
        lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        self.params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths] if params is None \
            else [params[i % len(params)] for i in range(len(prompts))]
        self.outputs: dict[str, list[int]] | None = {} if keep_outputs else None
        self.queue, self.in_flight = list(enumerate(prompts)), set()
        self.tokens, self.times, self.seconds, self.forward_seconds = 0, [], 0.0, 0.0
        # time to first token on this engine's own clock (its steps' wall time: with engines
        # interleaved, the others' turns are not in it)
        self.clock, self.added, self.ttfts = 0.0, {}, []
        self.pipelined = {"True": 0, "False": 0, "None": 0}
        self.prompt_steps = 0
        # wall seconds of the steps that carried a prompt, of the step right after each (where a
        # pipeline restarts), and of the rest: what arrivals cost a run beside its steady steps
        self.split = {"prompt": 0.0, "after_prompt": 0.0, "rest": 0.0}
        self._prompt_before = False
        self.before = dataclasses.asdict(engine.scheduler.stats)

    @property
    def done(self) -> bool:
        return not (self.queue or self.in_flight)

    def advance(self, max_steps: float = float("inf")) -> tuple[int, float]:
        """Up to ``max_steps`` steps: (tokens, wall seconds) of them."""
        engine, outputs = self.engine, self.outputs
        tokens, steps, t0, f0 = self.tokens, 0, time.perf_counter(), ForwardClock.seconds
        while not self.done and steps < max_steps:
            while self.queue and len(self.in_flight) < self.concurrency:
                i, p = self.queue.pop(0)
                engine.add_request(f"{self.tag}-{i}", p, self.params[i])
                self.in_flight.add(f"{self.tag}-{i}")
                self.added[f"{self.tag}-{i}"] = self.clock
            s0 = time.perf_counter()
            events = engine.step()
            self.clock += time.perf_counter() - s0
            for ev in events:
                if ev.token_ids and ev.request_id in self.added:
                    self.ttfts.append(self.clock - self.added.pop(ev.request_id))
                self.tokens += len(ev.token_ids)
                if outputs is not None:
                    outputs.setdefault(ev.request_id, []).extend(ev.token_ids)
                if ev.finish_reason is not None:
                    self.in_flight.discard(ev.request_id)
            self.times.append(time.perf_counter() - s0)
            steps += 1
            prompt = engine.last_step is not None and engine.last_step.has_prefill
            self.split["prompt" if prompt else "after_prompt" if self._prompt_before else "rest"] += self.times[-1]
            self._prompt_before = prompt
            if engine.last_step is not None:
                self.pipelined[str(engine.last_step.pipelined)] += 1
                self.prompt_steps += engine.last_step.has_prefill
            if self.on_step is not None:
                self.on_step(self)
        wall = time.perf_counter() - t0
        self.seconds += wall
        self.forward_seconds += ForwardClock.seconds - f0
        return self.tokens - tokens, wall

    def result(self) -> dict:
        q = statistics.quantiles(self.times, n=10)
        after = dataclasses.asdict(self.engine.scheduler.stats)
        return {"tokens": self.tokens, "steps": len(self.times), "seconds": round(self.seconds, 4),
                "tok_s": round(self.tokens / self.seconds, 1),
                "ms_per_step": round(self.seconds / len(self.times) * 1e3, 4), "step_p50_ms": round(q[4] * 1e3, 4),
                "step_p90_ms": round(q[8] * 1e3, 4),
                "host_us_per_step": round((self.seconds - self.forward_seconds) / len(self.times) * 1e6, 2),
                "pipelined": self.pipelined, "prompt_steps": self.prompt_steps,
                "seconds_by_step": {k: round(v, 4) for k, v in self.split.items()}, "fits": fits(self.engine.draft_policy),
                **ttft_quantiles(self.ttfts),
                "spec": {k: after[k] - self.before[k] for k in after if isinstance(after[k], int)}}


def ttft_quantiles(ttfts: list[float]) -> dict:
    if len(ttfts) < 2:
        return {}
    q = statistics.quantiles(ttfts, n=100)
    return {"ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 3), "ttft_p90_ms": round(q[89] * 1e3, 3),
            "ttft_p99_ms": round(q[98] * 1e3, 3)}


def run(engine: Engine, prompts: list[list[int]], concurrency: int, tag: str, lengths: int | list[int] = 128) -> dict:
    """One engine's whole run, with the garbage collector's passes during it."""
    loop, log = ClosedLoop(engine, prompts, concurrency, tag, lengths), CollectionLog()
    with log.recording(time.perf_counter()):
        loop.advance()
    return {**loop.result(), "gc": gc_by_generation(log)}


def gc_note(rec: dict) -> str:
    return f", gc {rec['gc']['count']} {sum(rec['gc']['ms']):.1f} ms" if "gc" in rec else ""


def run_interleaved(engines: dict, prompts: list[list[int]], concurrency: int, tag: str, turn_steps: int,
                    lengths: int | list[int] = 128, on_step=None, reference: str = "K=0") -> dict:
    """Every engine's run at once, taking turns of ``turn_steps`` steps (the order rotated each
    cycle): the host's speed, which on the H200 host moved 2x between runs a second apart, is
    then shared by all of them. Each engine's time is the sum of its turns; ``turns`` keeps the
    ratio to the ``reference`` engine of each cycle in which both ran a whole turn (tokens /
    seconds of the turn). ``on_step(name, loop)``: called after each step of engine ``name``."""
    loops = {n: ClosedLoop(e, prompts, concurrency, f"{tag}-{n}", lengths,
                           on_step=None if on_step is None else functools.partial(on_step, n))
             for n, e in engines.items()}
    names, cycle, turns = list(engines), 0, {n: [] for n in engines if n != reference}
    log = CollectionLog()
    with log.recording(time.perf_counter()):
        while not all(loop.done for loop in loops.values()):
            order = names[cycle % len(names):] + names[:cycle % len(names)]
            rate = {}
            for n in order:
                if not loops[n].done:
                    tokens, wall = loops[n].advance(turn_steps)
                    if not loops[n].done and wall > 0:
                        rate[n] = tokens / wall
            for n in turns:
                if n in rate and reference in rate:
                    turns[n].append(round(rate[n] / rate[reference], 4))
            cycle += 1
    out = {n: loop.result() for n, loop in loops.items()}
    for n in turns:
        out[n]["turn_ratios"] = turns[n]
    out[reference]["gc"] = gc_by_generation(log)
    return out


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


# the model's forwards (cProfile's keys for ORT's run calls): their own time is the device's (or,
# on the CPU, the model's), not the host's
FORWARDS = ("pybind11_state.run_with_iobinding>", "pybind11_state.run>")


ENGINE_FILES = {f"{m}.py" for m in ("engine", "pipeline", "scheduler", "proposer", "cuda_graphs", "cuda_kernels",
                                     "state_bank", "kv_pool", "prefix_cache", "output", "tokenizer", "speculative",
                                     "runner", "sampler", "draft_policy", "row_gather")}


# the A/B variants' name parts (--hold-ab, --lookahead-ab, --land-ab): auto is set against the fixed
# K of its own variant
VARIANTS = (" hold ", " lookahead ", " behind")


def forward(key: str) -> bool:
    return any(f in key for f in FORWARDS)


def profile_engines(engines: dict, prompts: list, concurrency: int, lengths: int | list[int] = 128) -> dict:
    """cProfile one run of K=0, the engine that never drafts, auto and each fixed K (those
    present): each one's host time per step and per generated token (own time outside the
    model's forwards), and what each adds to the one before it, largest first."""
    import cProfile
    import pstats
    own, calls, host, per_token, cum = {}, {}, {}, {}, {}
    names = [n for n in ("K=0", "never drafts", "auto") if n in engines] + \
        [n for n in engines if n.startswith("K=") and n != "K=0"]
    for name in names:
        pr = cProfile.Profile()
        pr.enable()
        r = run(engines[name], prompts, concurrency, f"prof-{name}", lengths)
        pr.disable()
        st = pstats.Stats(pr).stats
        key = [(f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}", v) for k, v in st.items()]
        own[name] = {k: v[2] / r["steps"] * 1e6 for k, v in key}
        cum[name] = {k: v[3] / r["steps"] * 1e6 for k, v in key}
        calls[name] = {k: v[1] / r["steps"] for k, v in key}
        host[name] = sum(t for k, t in own[name].items() if not forward(k))
        per_token[name] = host[name] * r["steps"] / r["tokens"]
        print(f"profiled {name}: {r['ms_per_step']:.3f} ms/step, host {host[name]:.1f} us/step, "
              f"{per_token[name]:.1f} us/token (own time outside the forwards, under cProfile)", flush=True)
    out = {"host_us_per_step": {n: round(h, 1) for n, h in host.items()},
           "host_us_per_token": {n: round(h, 1) for n, h in per_token.items()}}
    for name in names:          # where each engine's host time goes: own time, and the engine's calls' cumulative
        top = sorted(((t, k) for k, t in own[name].items() if not forward(k)), reverse=True)[:40]
        inside = sorted(((t, k) for k, t in cum[name].items() if k.split(":")[0] in ENGINE_FILES), reverse=True)[:40]
        print(f"{name}: own time per step (us), largest first:")
        for t, k in top:
            print(f"  {t:7.1f}  {k}  calls/step {calls[name].get(k, 0):.2f}")
        print(f"{name}: cumulative time per step (us) in the engine's files, largest first:")
        for t, k in inside:
            print(f"  {t:7.1f}  {k}  calls/step {calls[name].get(k, 0):.2f}")
        out[f"{name}_own_us"] = [(k, round(t, 2), round(calls[name].get(k, 0), 3)) for t, k in top]
        out[f"{name}_cumulative_us"] = [(k, round(t, 2), round(calls[name].get(k, 0), 3)) for t, k in inside]
    for a, b in zip(names, names[1:]):
        diff = sorted(((own[b].get(k, 0.0) - own[a].get(k, 0.0), k) for k in set(own[a]) | set(own[b])
                       if not forward(k)), reverse=True)
        print(f"own time per step, {b} minus {a} (us), host total {host[b] - host[a]:.1f}:")
        for d, k in diff[:25]:
            print(f"  {d:7.1f}  {k}  calls/step {calls[b].get(k, 0):.2f} vs {calls[a].get(k, 0):.2f}")
        out[f"{b}_minus_{a}_us"] = [(k, round(d, 2), round(calls[b].get(k, 0), 3)) for d, k in diff[:40]]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--device", default="cuda")
    p.add_argument("--freeze", action="store_true")
    p.add_argument("--overlap", action="store_true", help="overlapped decoding on the CPU too (CUDA's default path; "
                   "with a tiny model the host's share of a step is then near the H200's)")
    p.add_argument("--fixed", default="", help="fixed draft counts to run beside them, e.g. 2,3")
    p.add_argument("--synthetic", type=float, default=None, help="synthetic acceptance (an untrained head)")
    p.add_argument("--random-prompts", type=int, default=0, help="random prompts of this many tokens")
    p.add_argument("--bursts", action="store_true", help="also the adaptive policy exploring in bursts")
    p.add_argument("--table", action="store_true", help="also the adaptive policy on a timed step-cost table")
    p.add_argument("--interleave", type=int, default=0, metavar="STEPS",
                   help="run the engines at once, taking turns of this many steps (0: one whole run after another)")
    p.add_argument("--no-fit", action="store_true", help="leave out auto on the fit (serve's default)")
    p.add_argument("--no-never", action="store_true", help="leave out the engine that never drafts (on the 1.4 B "
                   "model four engines' captures do not fit one H200: session 18's bb ran out of memory building a fourth)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="output lengths drawn from 128 x [1 - R, 1 + R], "
                   "the same for every engine (bench's --range-ratio; 0: 128 for all, so a closed loop's requests "
                   "arrive in waves)")
    p.add_argument("--eager-fills", action="store_true", help="beside each fixed K and auto, the same engine with "
                   "the head's catch-up of new prompts in eager forwards (no HeadGraphs.fill: session 26's A/B)")
    p.add_argument("--after-decode", action="store_true", help="beside auto and each fixed K, the same engine with "
                   "Engine.draft_after_decode on (a draft step launched behind a decode or prompt step)")
    p.add_argument("--hold-ab", type=int, default=None, metavar="STEPS",
                   help="beside each engine, the same engine with admission_hold_steps=STEPS (0: arrivals "
                        "admitted at once; the others keep the device's default)")
    p.add_argument("--land-ab", action="store_true", help="beside K=0, auto and each fixed K, the same engine with "
                   "Engine.land_prompts_first off (a prompt step lands after its continuation's launch, as before "
                   "session 28)")
    p.add_argument("--lookahead-ab", default="", metavar="STEPS",
                   help="beside auto and each fixed K, the same engine with admission_lookahead=STEPS (a gathered "
                        "group of arrivals waits, within the hold, for requests expected to end within STEPS "
                        "steps); a comma-separated list gives one engine each")
    p.add_argument("--profile", action="store_true", help="after the rounds, cProfile one run of K=0, the engine "
                   "that never drafts and auto: each one's host time per step, and the differences, largest first")
    args = p.parse_args()
    ForwardClock.install()
    base = EngineConfig(args.model_dir, device=args.device, overlap_decode=True if args.overlap else None)

    def spec(k):
        return SpecConfig(k, synthetic_acceptance=args.synthetic if k != 0 else None)
    engines = {"K=0": Engine(dataclasses.replace(base, spec=spec(0)))}
    device_memory("K=0", engines["K=0"])
    if not args.no_fit:
        engines["auto"] = Engine(dataclasses.replace(base, spec=spec("auto")))
        device_memory("auto", engines["auto"])
    if not args.no_never:
        engines["never drafts"] = Engine(dataclasses.replace(base, spec=spec("auto")), draft_policy=FixedDraftPolicy(0))
    if args.bursts:
        policy = AdaptiveDraftPolicy(min(MAX_NUM_DRAFTS, engines["K=0"].manifest.capture_capacity), explore_interval=64,
                                     explore_burst=4, fit_pipelined_only=True)
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
    # the MTP engines on the fit and at fixed K, each built again for the A/B variants below
    mtp = {n: spec("auto") if n == "auto" else spec(int(n[2:]))
           for n in engines if n == "auto" or (n.startswith("K=") and n != "K=0")}
    for name, kind in mtp.items():
        if args.after_decode:     # auto switching from decode steps to drafting pays a step launched alone without it
            engine = engines[f"{name} after decode"] = Engine(dataclasses.replace(base, spec=kind))
            engine.draft_after_decode = True
        if args.eager_fills:      # fills off: _catch_up_long then runs eager head forwards
            engine = engines[f"{name} eager fills"] = Engine(dataclasses.replace(base, spec=kind))
            if engine.proposer is not None and engine.proposer.graphs is not None:
                engine.proposer.graphs.fill_counts = ()
    if args.hold_ab is not None:
        for name in [n for n in engines if " " not in n]:       # K=0, auto, each fixed K (not the variants)
            e = engines[name]
            hold = dataclasses.replace(e.config.scheduler, admission_hold_steps=args.hold_ab)
            engines[f"{name} hold {args.hold_ab}"] = Engine(dataclasses.replace(e.config, scheduler=hold))
    if args.land_ab:
        for name in [n for n in engines if " " not in n]:
            engine = engines[f"{name} behind"] = Engine(engines[name].config)
            engine.land_prompts_first = False
            device_memory(f"{name} behind", engine)
    for steps in [int(x) for x in filter(None, args.lookahead_ab.split(","))]:
        for name in mtp:
            e = engines[name]
            ahead = dataclasses.replace(e.config.scheduler, admission_lookahead=steps)
            engines[f"{name} lookahead {steps}"] = Engine(dataclasses.replace(e.config, scheduler=ahead))
            device_memory(f"{name} lookahead {steps}", engines[f"{name} lookahead {steps}"])
    e0 = engines["K=0"]
    if args.random_prompts:
        rng = np.random.default_rng(0)
        prompts = rng.integers(3, e0.manifest.vocab_size, (args.requests, args.random_prompts)).tolist()
    else:
        prompts = text_workload(BUNDLED_PROMPTS, e0.tokenizer.encode, args.requests).prompt_ids
    lengths = output_lengths(len(prompts), 128, args.range_ratio) or 128
    names = list(engines)
    for name, e in engines.items():          # one run each first: prefix caches filled alike
        run(e, prompts, args.concurrency, f"warm-{name}", lengths)
    if args.freeze:
        gc.collect()
        gc.freeze()
    rounds = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if args.interleave:
            rec = run_interleaved({n: engines[n] for n in order}, prompts, args.concurrency, f"r{r}", args.interleave,
                                  lengths)
        else:
            rec = {name: run(engines[name], prompts, args.concurrency, f"r{r}-{name}", lengths) for name in order}
        for name in names[1:]:
            rec[name]["vs_k0"] = round(rec[name]["tok_s"] / rec["K=0"]["tok_s"], 4)
        rounds.append({"order": order, **rec})
        print(f"round {r}: " + "  ".join(f"{n} {rec[n]['tok_s']:.0f} tok/s {rec[n]['ms_per_step']:.3f} ms/step "
                                         f"(p50 {rec[n]['step_p50_ms']:.3f} p90 {rec[n]['step_p90_ms']:.3f}, "
                                         f"host {rec[n]['host_us_per_step']:.1f} us"
                                         + f", {rec[n].get('prompt_steps', 0)} prompt steps"
                                         + (f", TTFT p50 {rec[n]['ttft_p50_ms']:.2f} p99 {rec[n]['ttft_p99_ms']:.2f} ms"
                                            if "ttft_p50_ms" in rec[n] else "")
                                         + gc_note(rec[n]) + ")"
                                         + (f" ({rec[n]['vs_k0']:.3f}x)" if n != "K=0" else "") for n in names),
              flush=True)
        save(args, rounds, {})                  # each round kept: a run cut by its timeout still says something
    summary = {n: {"median_vs_k0": statistics.median(r[n]["vs_k0"] for r in rounds),
                   "ratios": [r[n]["vs_k0"] for r in rounds]} for n in names[1:]}
    if args.interleave:
        for n in names[1:]:
            turns = [x for r in rounds for x in r[n].get("turn_ratios", [])]
            if turns:
                summary[n]["turns_median_vs_k0"] = statistics.median(turns)
                summary[n]["turns"] = len(turns)
    for n, s in summary.items():
        print(f"{n}: median {s['median_vs_k0']:.3f}x K=0 over {args.rounds} rounds "
              f"(min {min(s['ratios']):.3f}, max {max(s['ratios']):.3f})"
              + (f"; median of {s['turns']} turns {s['turns_median_vs_k0']:.3f}x" if "turns" in s else ""), flush=True)
    if args.profile:
        summary["profile"] = profile_engines(engines, prompts, args.concurrency, lengths)
    for name in [n for n in names if n.startswith("auto")]:
        variant = next((name[name.index(v):] for v in VARIANTS if v in name), "")        # like with like
        fixed = [n for n in names if n.startswith("K=") and not n.endswith(" eager fills")      # (the old catch-up)
                 and (n.endswith(variant) if variant else all(v not in n for v in VARIANTS))]
        if variant.startswith(" lookahead "):         # (K=0 never holds: it has no lookahead variant)
            fixed.insert(0, "K=0")
        if len(fixed) > 1:
            vs_best = [r[name]["tok_s"] / max(r[n]["tok_s"] for n in fixed) for r in rounds]
            summary[f"{name}_vs_best_fixed"] = {"median": statistics.median(vs_best), "ratios": [round(x, 4) for x in vs_best]}
            print(f"{name}: median {statistics.median(vs_best):.3f}x the round's best fixed K ({', '.join(fixed)})", flush=True)
    save(args, rounds, summary)


def save(args, rounds: list, summary: dict) -> None:
    with open(args.out, "w") as f:
        json.dump({"model": args.model_dir, "concurrency": args.concurrency, "requests": args.requests,
                   "freeze": args.freeze, "range_ratio": args.range_ratio, "rounds": rounds, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
