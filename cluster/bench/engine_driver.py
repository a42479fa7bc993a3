"""The in-process side of `mtpserve bench`: one Engine per draft count, driven at each load.

Closed loop (a concurrency C): C requests start at once; each finished request is replaced by the
next until N have run. Open loop (a request rate): requests are added when their Poisson arrival
time has passed, checked between steps. A token's time is when the step that produced it
returned; a request's arrival is when it was due (so queueing counts in its TTFT).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass, replace

from mtpserve.cluster.bench.report import LoadRun, RequestRecord, distribution_ms
from mtpserve.cluster.bench.workload import Load, Submitter, Workload, per_load
from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.speculative import MAX_NUM_DRAFTS, SpecDecodeStats


@dataclass(frozen=True)
class EngineSweep:
    """Everything the engine side needs, as plain values."""
    model_dir: str
    device: str
    num_threads: int
    draft_tokens: tuple[int | str, ...]       # fixed counts, "auto", or "auto-timed" (auto on a timed table)
    synthetic_acceptance: float | None
    loads: tuple[Load, ...]
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    num_blocks: int | None = None
    max_resident_requests: int | None = None
    max_tokens_per_step: int | None = None
    max_model_len: int | None = None
    num_warmup_requests: int = 4
    timeout_s: float = 600.0
    cuda_graphs: bool = True
    prefix_cache: bool = True
    prefix_snapshots: str = "reused"        # the cache's snapshot policy (engine.config CacheConfig)
    phases: str = "off"                     # per-phase step times (engine/phase_timers.py): off, on or sync
    overlap_decode: bool | None = None      # EngineConfig.overlap_decode (None: the engine's default)
    kv_block_size: int | None = None        # CacheConfig.kv_block_size (None: the export's)
    prompt_graphs: bool | None = None       # EngineConfig.prompt_graphs (None: the engine's default, on with CUDA graphs)
    prompt_graph_rows: int | None = None    # EngineConfig.prompt_graph_rows (None: the engine's default)
    prompt_graph_slot_tokens: int | None = None     # EngineConfig.prompt_graph_slot_tokens (None: the default)


NO_PREFIX_CACHE = "mtpserve no-prefix-cache"     # the system label of runs with the prefix cache off
SNAPSHOTS_ALL = "mtpserve snapshots-all"   # ... and with it on, every prompt boundary snapshotted
NO_OVERLAP = "mtpserve no-overlap"       # ... and with overlapped decoding turned off where it is the default


def engine_config(sweep: EngineSweep, k: int | str, block_size: int, max_prompt_len: int,
                  num_requests: int, max_output_len: int) -> EngineConfig:
    """Pools sized so every load can keep its requests resident (unless told otherwise), each up
    to ``max_prompt_len`` + ``max_output_len`` tokens; k is a fixed draft count, "auto" (the
    adaptive policy on its fits) or "auto-timed" (on a table of step costs timed at start-up:
    ``SpecConfig.draft_calibration``)."""
    peak = max((l.concurrency or num_requests) for l in sweep.loads)
    resident = sweep.max_resident_requests or max(1, min(peak, 256))
    adaptive = isinstance(k, str)
    most_drafts = MAX_NUM_DRAFTS if adaptive else k
    per_request = math.ceil((max_prompt_len + max_output_len + most_drafts + 1) / block_size) + 1
    num_blocks = sweep.num_blocks or max(64, resident * per_request + 8)
    default = SchedulerConfig().for_device(sweep.device).max_tokens_per_step
    budget = sweep.max_tokens_per_step or max(default, resident * (most_drafts + 1))
    return EngineConfig(sweep.model_dir, device=sweep.device, num_threads=sweep.num_threads,
                        cache=CacheConfig(num_blocks=num_blocks, max_resident_requests=resident,
                                          prefix_cache=sweep.prefix_cache, prefix_snapshots=sweep.prefix_snapshots,
                                          kv_block_size=sweep.kv_block_size),
                        scheduler=SchedulerConfig(max_tokens_per_step=budget, max_requests_per_step=resident),
                        spec=SpecConfig(draft_tokens="auto" if adaptive else k, draft_calibration=k == "auto-timed",
                                        synthetic_acceptance=sweep.synthetic_acceptance if k else None),
                        max_model_len=sweep.max_model_len, cuda_graphs=sweep.cuda_graphs,
                        overlap_decode=sweep.overlap_decode,
                        prompt_graphs=sweep.prompt_graphs,
                        **{name: value for name in ("prompt_graph_rows", "prompt_graph_slot_tokens")
                           if (value := getattr(sweep, name)) is not None})


def sampling_params(sweep: EngineSweep, max_tokens: int, i: int) -> SamplingParams:
    return SamplingParams(temperature=sweep.temperature, seed=sweep.seed + i, max_tokens=max_tokens,
                          ignore_eos=sweep.ignore_eos)


@contextlib.contextmanager
def start_up_frozen():
    """What start-up built (ORT sessions, captured graphs, the engine's pools and tables) kept out
    of the cycle collector's full collections for the block, as a serving process keeps it
    (``actors/worker.py``, ``actors/engine_process.py``: ``gc.freeze()`` after start-up). Else a
    full collection, which a load's allocations trigger now and then, rescans all of it: ~10 ms
    with the bundled model's ~39k start-up objects on a 2-core host, a step the report flags as
    slow. Unfrozen after, so an engine the block used can be collected (its cycles would
    otherwise hold its device memory past ``del``)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_engine_sweep(sweep: EngineSweep, workload: Workload, block_size: int, log=print) -> list[LoadRun]:
    """Every draft count at every load, against the same prompts."""
    runs = []
    for k in sweep.draft_tokens:
        engine = ready_engine(sweep, k, workload, block_size, log)
        timers = phase_timers(sweep, engine)
        with start_up_frozen():
            runs += _sweep_loads(engine, sweep, workload, k, timers, log)
        del engine, timers
        gc.collect()                        # its cycles (and device memory) go before the next one's start-up
    return runs


def _sweep_loads(engine: Engine, sweep: EngineSweep, workload: Workload, k: int | str, timers, log) -> list[LoadRun]:
    """``run_engine_sweep``'s loads on one engine, each logged."""
    runs = []
    for i, (load, wl) in enumerate(per_load(workload, sweep.loads, sweep.seed)):
        run = run_load(engine, sweep, wl, load, k, tag=f"k{k}l{i}", timers=timers)
        slow = run.extra.get("slow_steps") or []
        log(f"mtpserve K={k} {run.load_label}: {sum(r.num_output_tokens for r in run.records)} tokens "
            f"in {run.duration_s:.2f} s, {run.extra['prompt_steps']} prompt steps"
            + (f", the host waited for the device {run.extra['overlap']['device_wait_ms_per_step']:.3f} ms a step"
               if sweep.device != "cpu" else "")
            + (f" — {run.error}" if run.error else "")
            + (f"; {len(slow)} slow step(s), the worst {max(f['ms'] for f in slow):.1f} ms "
               f"({sum(f['gc_ms'] > 0 for f in slow)} with a cycle collection inside, "
               f"{sum(f['device_wait_ms'] for f in slow):.1f} ms waiting for the device in all)" if slow else "")
            + (f"; steps by draft depth {run.extra['draft_depths']}" if "draft_depths" in run.extra else ""))
        runs.append(run)
    return runs


def ready_engine(sweep: EngineSweep, k: int | str, workload: Workload, block_size: int, log=print) -> Engine:
    """The engine of draft count ``k`` for this sweep, built (its start-up logged) and warmed up
    on ``workload``'s warm-up prompts."""
    config = engine_config(sweep, k, block_size, max(len(p) for p in workload.prompt_ids), workload.num_requests,
                           max(workload.output_lens or [sweep.max_tokens]))
    started = time.perf_counter()
    engine = Engine(config)
    graphs = "; ".join(f"{what} {g.num_graphs} in {g.capture_seconds:.1f} s, {g.memory_bytes / 2**20:.0f} MiB"
                       + ("" if g.on_device else " (bound on the CPU, run eagerly)")
                       for what, g in engine.graph_sets().items())
    log(f"mtpserve K={k}: engine ready in {time.perf_counter() - started:.1f} s "
        f"({engine.kv_pool.num_blocks} blocks, {config.cache.max_resident_requests} resident; "
        + (f"graphs: {graphs}" if graphs else "no CUDA graphs")
        + (f"; prompt graphs off: {engine.prompt_graphs_off}" if engine.prompt_graphs_off else "") + ")")
    if sweep.num_warmup_requests:
        n = min(sweep.num_warmup_requests, workload.num_requests)
        run_load(engine, sweep, workload.warmup(n), Load(concurrency=n), k, tag=f"warmup{k}",
                 max_tokens=min(16, sweep.max_tokens))
    return engine


def phase_timers(sweep: EngineSweep, engine: Engine):
    """``PhaseTimers`` on ``engine`` when the sweep asks for phases (after its warm-up), else None."""
    if sweep.phases == "off":
        return None
    from mtpserve.engine.phase_timers import PhaseTimers
    return PhaseTimers(engine, sync=sweep.phases == "sync")


def run_engine_rounds(sweep: EngineSweep, workload: Workload, block_size: int, rounds: int,
                      log=print) -> list[LoadRun]:
    """Every draft count at every load, ``rounds`` times, interleaved: one engine per draft count
    built once, then each round runs each load with every engine back to back, in an order that
    rotates by one each round. A ratio within one round then cancels drift that is slow next to a
    round (on a shared host the same fixed K moved by up to 1.4x between runs made one after
    another). Each run's ``extra["round"]`` says its round; a workload that makes fresh prompt
    sets gives every (round, load) a set of its own, the same for every draft count."""
    engines = {k: ready_engine(sweep, k, workload, block_size, log) for k in sweep.draft_tokens}
    timers = {k: phase_timers(sweep, e) for k, e in engines.items()}
    with start_up_frozen():
        return _rounds(engines, timers, sweep, workload, rounds, log)


def _rounds(engines: dict, timers: dict, sweep: EngineSweep, workload: Workload, rounds: int, log) -> list[LoadRun]:
    """``run_engine_rounds``'s rounds on its engines."""
    ks, runs = list(sweep.draft_tokens), []
    for r in range(rounds):
        sets = per_load(workload if workload.fresh is None else _offset_sets(workload, r * len(sweep.loads)),
                        sweep.loads, sweep.seed + r)
        for i, (load, wl) in enumerate(sets):
            order = ks[r % len(ks):] + ks[:r % len(ks)]
            for k in order:
                run = run_load(engines[k], sweep, wl, load, k, tag=f"r{r}k{k}l{i}", timers=timers[k])
                run.extra["round"] = r
                runs.append(run)
            log(f"round {r + 1}/{rounds} {load.label}: " + ", ".join(
                f"K={run.num_draft_tokens} {sum(x.num_output_tokens for x in run.records) / run.duration_s:.0f} tok/s"
                for run in runs[-len(ks):]))
    return runs


def _offset_sets(workload: Workload, offset: int) -> Workload:
    """``workload`` whose prompt set i is its set ``offset + i`` (set 0 stays the warm-up's)."""
    return replace(workload, fresh=lambda i: workload.fresh(offset + i))


def run_load(engine: Engine, sweep: EngineSweep, workload: Workload, load: Load, k: int, tag: str,
             max_tokens: int | None = None, timers=None) -> LoadRun:
    """Drive `engine` through every request of `workload` at `load`; returns the timeline (with
    ``timers``, a ``PhaseTimers`` on the engine: its per-phase step times in ``extra["phases"]``).
    ``max_tokens``: one length for every request (a warm-up's); else each request's own from the
    workload (``Workload.max_tokens``)."""
    prompts, n = workload.prompt_ids, workload.num_requests
    records: dict[str, RequestRecord] = {}
    requests = []
    steps0, preempt0, wait0 = engine.num_steps, engine.num_preemptions, engine.device_wait_s
    continuations0, blockers0 = engine.num_continuations, dict(engine.overlap_blockers)
    draft_continuations0, dead0 = engine.num_draft_continuations, engine.num_dead_carried
    depths0 = dict(getattr(engine.draft_policy, "depths", {}))     # --draft-tokens auto's planned depths
    replays0 = engine.graphs.num_replays if engine.graphs is not None else 0
    prompt_graphs = engine.prompt_graphs
    prompt_replays0 = prompt_graphs.num_replays if prompt_graphs is not None else 0
    cache_stats = engine.prefix_cache.stats if engine.prefix_cache is not None else None
    hits0, queries0 = (cache_stats.hits, cache_stats.queries) if cache_stats else (0, 0)
    step_times: list[float] = []
    step_shapes: list[tuple] = []
    step_starts: list[float] = []    # (seconds from t0) with the host's waits for the device a step:
    step_waits: list[float] = []     # what a flagged step is annotated with (attribute_slow_steps)
    step_calls: list[dict] = []      # ... and what else its call did (the step's own shape aside)
    prompt_continuations = engine.num_prompt_continuations
    recordings0 = engine.step_recordings.stats() if engine.step_recordings is not None else None
    recorded = recordings0["recorded"] if recordings0 is not None else 0
    collections = CollectionLog()
    prompt_steps = 0                # steps that fed a prompt (chunk): how many arrivals shared one (admission holds)
    if timers is not None:
        timers.reset()
    t0 = time.perf_counter()

    def submit(i: int, arrival: float) -> None:
        rid = f"{tag}-{i}"
        length = max_tokens or workload.max_tokens(i, sweep.max_tokens)
        requests.append(engine.add_request(rid, prompts[i], sampling_params(sweep, length, i)))
        records[rid] = RequestRecord(rid, len(prompts[i]), arrival)

    schedule = Submitter(workload, load, submit)
    num_done, error = 0, None
    with collections.recording(t0):      # (its callback removed whatever the step raises)
        while num_done < n:
            now = time.perf_counter() - t0
            if now > sweep.timeout_s:
                error = f"timed out after {sweep.timeout_s:g} s with {n - num_done} of {n} requests unfinished"
                break
            schedule.arrive(now)
            if not engine.has_work:
                if schedule.wait_for_next(time.perf_counter() - t0):
                    continue
                error = f"the engine went idle with {n - num_done} requests unfinished"
                break
            w, s = engine.device_wait_s, time.perf_counter()
            events = engine.step()
            t = time.perf_counter()
            step_times.append(t - s)
            step_starts.append(s - t0)
            step_waits.append(engine.device_wait_s - w)
            last = engine.last_step
            launched = engine.num_prompt_continuations - prompt_continuations
            prompt_continuations = engine.num_prompt_continuations
            call = {"pipelined": None if last is None else last.pipelined,
                    "after_prompt_step": bool(step_shapes) and step_shapes[-1] is not None and step_shapes[-1][2],
                    "prompt_steps_launched": launched}
            if engine.step_recordings is not None:    # a recording made in the call: a first-call cost (~2 ms)
                call["steps_recorded"] = engine.step_recordings.num_recorded - recorded
                recorded = engine.step_recordings.num_recorded
            step_calls.append(call)
            prompt_steps += last is not None and last.has_prefill
            # a call that launched a prompt step behind its draft step (and queued the head's
            # catch-up on those prompts) did that work too: its own kind among the shapes
            step_shapes.append(None if last is None else
                               (last.num_requests, last.num_main_tokens, last.has_prefill, last.graphed,
                                last.num_head_rows.bit_length(), launched > 0))
            t -= t0
            for ev in events:
                rec = records[ev.request_id]
                if ev.token_ids:
                    rec.add_chunk(t, len(ev.token_ids))
                if ev.finish_reason is not None:
                    rec.finish_s, rec.finish_reason = t, ev.finish_reason.value
                    rec.num_output_tokens = ev.num_output_tokens
                    num_done += 1
                    schedule.finished(t)
    end = time.perf_counter() - t0
    if error is not None:
        for rid, rec in records.items():
            if rec.finish_s is None:
                engine.abort(rid)
                rec.error = "unfinished"
    stats = SpecDecodeStats()
    for r in requests:
        stats = stats.merged(r.stats)
    finished = [r.finish_s for r in records.values() if r.finish_s is not None]
    num_steps = engine.num_steps - steps0
    extra = {"num_steps": num_steps, "num_preemptions": engine.num_preemptions - preempt0,
             "prompt_steps": prompt_steps,
             "step_ms": distribution_ms(step_times),
             "slow_steps": attribute_slow_steps(slow_steps(step_times, step_shapes), step_starts, step_times,
                                                step_waits, collections.spans, step_calls),
             "gc": collections.summary(),
             "graph_steps": (engine.graphs.num_replays - replays0) if engine.graphs is not None else 0,
             # prompt steps replayed from captured varlen graphs (--prompt-graphs; None: off)
             "prompt_graph_steps": prompt_graphs.num_replays - prompt_replays0 if prompt_graphs is not None else None,
             "prompt_graphs_off": engine.prompt_graphs_off,
             "engine": {"num_blocks": engine.kv_pool.num_blocks,
                        "max_resident_requests": engine.config.cache.max_resident_requests,
                        "max_tokens_per_step": engine.config.scheduler.max_tokens_per_step,
                        # each graph set's start-up: shapes, seconds, device MiB (prompt: bound on the CPU)
                        "graphs": {what: {"count": g.num_graphs, "capture_s": round(g.capture_seconds, 3),
                                          "mib": round(g.memory_bytes / 2**20, 1)}
                                   for what, g in engine.graph_sets().items()}}}
    if timers is not None:
        extra["phases"] = timers.summary()
    if recordings0 is not None:     # steady draft steps launched as recordings, and why the others were not
        extra["step_recordings"] = recording_counts(recordings0, engine.step_recordings.stats())
    depths = getattr(engine.draft_policy, "depths", None)
    if depths is not None:          # steps planned at each draft depth (auto): what it chose
        extra["draft_depths"] = {str(d): n - depths0.get(d, 0) for d, n in sorted(depths.items()) if n > depths0.get(d, 0)}
    table = getattr(engine.draft_policy, "cost_table", None)
    if table is not None:           # auto-timed: its table, and what live steps said of it so far
        extra["draft_table"] = table.report()
    if engine.prefix_cache is not None:
        extra["prefix_cache"] = {"hit_tokens": engine.prefix_cache.stats.hits - hits0,
                                 "query_tokens": engine.prefix_cache.stats.queries - queries0,
                                 "snapshots": engine.prefix_cache.num_snapshots,
                                 "snapshot_bytes": engine.prefix_cache.num_snapshots
                                 * engine.state_bank.spec.bytes_per_row(num_banks=1)}
    extra["overlap"] = {"on": engine.overlap, "continuations": engine.num_continuations - continuations0,
                        "draft_continuations": engine.num_draft_continuations - draft_continuations0,
                        "dead_rows_carried": engine.num_dead_carried - dead0,
                        # the host's wait for steps' tokens: near zero, the loop is host-bound
                        "device_wait_ms_per_step": round((engine.device_wait_s - wait0) * 1e3 / max(1, num_steps), 4),
                        "blockers": {why: n - blockers0.get(why, 0) for why, n in engine.overlap_blockers.items()
                                     if n > blockers0.get(why, 0)}}
    system = NO_PREFIX_CACHE if engine.prefix_cache is None else \
        SNAPSHOTS_ALL if engine.config.cache.prefix_snapshots == "all" else \
        NO_OVERLAP if sweep.overlap_decode is False else "mtpserve"
    return LoadRun(system, k, engine.config.spec.synthetic_acceptance, load.concurrency, load.request_rate,
                   end if error else max(finished, default=end), list(records.values()), _spec_counts(stats), extra, error)


SLOW_STEP_FACTOR = 3.0


def slow_steps(seconds: list[float], shapes: list[tuple | None], factor: float = SLOW_STEP_FACTOR,
               min_count: int = 5) -> list[dict]:
    """Steps longer than ``factor`` x the median of their peers: a first-call cost or a stall
    that landed on live traffic. Empty is the goal.

    A step's shape is (requests, rows, prefill or not, graphed or not, the power-of-two class
    of the rows the MTP head caught up on: ``num_head_rows.bit_length()``, then any more marks
    of what its call did, e.g. whether it launched a prompt step behind it). Its peers are the
    steps of its own shape when there are at least ``min_count`` of them (``median_of:
    "shape"``); else the steps of its kind (prefill or not, graphed or not, the same marks, a
    head class at most one apart) with between half and twice its rows, when there are that
    many (``"similar"``: a burst's one slow step has a shape of its own, and was missed by the
    own-shape median alone); else it is not judged. (A drafting step whose head catches up on
    new prompts does that work, not a stall: on the H200 such steps were flagged at 4-6x a
    steady step's time; so does a call that launches a prompt step behind its draft step and
    queues the head's catch-up on those prompts: 3-4 ms against a 1 ms median, session 40's
    timeline.)"""
    by_shape: dict[tuple, list[float]] = {}
    for t, shape in zip(seconds, shapes):
        if shape is not None:
            by_shape.setdefault(shape, []).append(t)
    medians = {k: sorted(v)[len(v) // 2] for k, v in by_shape.items() if len(v) >= min_count}

    def peers(shape):
        if shape in medians:
            return medians[shape], "shape"
        _, rows, prefill, graphed, head, *marks = shape
        near = sorted(t for other, ts in by_shape.items() for t in ts if other != shape
                      and other[2:4] == (prefill, graphed) and list(other[5:]) == marks
                      and abs(other[4] - head) <= 1 and rows / 2 <= other[1] <= rows * 2)
        return (near[len(near) // 2], "similar") if len(near) >= min_count else (None, None)

    flagged = []
    for i, (t, shape) in enumerate(zip(seconds, shapes)):
        if shape is None:
            continue
        median, of = peers(shape)
        if median is not None and t > factor * median:
            flagged.append({"step": i, "ms": round(t * 1e3, 3), "median_ms": round(median * 1e3, 3),
                            "median_of": of, "requests": shape[0], "rows": shape[1], "prefill": shape[2],
                            "graphed": shape[3], "head_rows_below": 1 << shape[4]})
    return flagged


class CollectionLog:
    """The cycle collector's runs during a load (``gc.callbacks``): ``spans`` of (start, stop,
    generation), seconds from the load's start. A full collection rescanning what start-up
    left unfrozen cost ~10 ms on a 2-core host, a step the report would flag as slow."""

    def __init__(self):
        self.spans: list[tuple[float, float, int]] = []
        self._t0 = self._began = 0.0

    @contextlib.contextmanager
    def recording(self, t0: float):
        """Collections are logged inside the block (``t0``: the load's start, perf_counter)."""
        self._t0 = t0
        gc.callbacks.append(self._note)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict) -> None:
        now = time.perf_counter() - self._t0
        if phase == "start":
            self._began = now
        else:
            self.spans.append((self._began, now, info["generation"]))

    def summary(self) -> dict:
        """Per generation, how many collections ran and their total and longest milliseconds."""
        out: dict[str, dict] = {}
        for start, stop, generation in self.spans:
            g = out.setdefault(str(generation), {"count": 0, "ms": 0.0, "max_ms": 0.0})
            g["count"] += 1
            g["ms"] += (stop - start) * 1e3
            g["max_ms"] = max(g["max_ms"], (stop - start) * 1e3)
        return {gen: {"count": g["count"], "ms": round(g["ms"], 3), "max_ms": round(g["max_ms"], 3)}
                for gen, g in sorted(out.items())}


def attribute_slow_steps(flagged: list[dict], starts: list[float], seconds: list[float], waits: list[float],
                         collections: list[tuple[float, float, int]], calls: list[dict] | None = None) -> list[dict]:
    """``slow_steps``' records with where each slow step's time went, as far as the host can
    tell: ``device_wait_ms`` (the host waiting for a step's tokens: the GPU's side) and
    ``gc_ms`` / ``gc_generations`` (cycle collections that ran inside the step). What is left
    is the host's own work or the host being slow (another process, the OS). ``calls``: per
    step, what else its call did (``pipelined``: launched by the call before, or launched and
    landed in this one; ``after_prompt_step``; ``prompt_steps_launched`` behind it; with step
    recordings, ``steps_recorded``: a recording made, a one-time cost), copied in."""
    for f in flagged:
        i = f["step"]
        if calls is not None:
            f.update(calls[i])
        begin, end = starts[i], starts[i] + seconds[i]
        inside = [(max(a, begin), min(b, end), g) for a, b, g in collections if a < end and b > begin]
        f["device_wait_ms"] = round(waits[i] * 1e3, 3)
        f["gc_ms"] = round(sum(b - a for a, b, _ in inside) * 1e3, 3)
        f["gc_generations"] = sorted({g for _, _, g in inside})
    return flagged


def recording_counts(before: dict, after: dict) -> dict:
    """``StepRecordings.stats()`` over one load: its counters' growth (draft steps launched as a
    recording, recorded, queued call by call; the unsteady ones by why), the rest as they are."""
    out = {}
    for name, value in after.items():
        if name == "skipped":
            out[name] = {why: n - before[name].get(why, 0) for why, n in value.items() if n > before[name].get(why, 0)}
        elif isinstance(value, int) and name != "recordings":
            out[name] = value - before[name]
        else:
            out[name] = value
    return out


def _spec_counts(s: SpecDecodeStats) -> dict:
    return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens, "num_target_forwards": s.num_target_forwards,
            "num_emitted_tokens": s.num_emitted_tokens, "accepted_per_position": list(s.accepted_per_position),
            "drafted_per_position": list(s.drafted_per_position)}
