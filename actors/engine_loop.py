"""The engine's owner thread: one thread steps the engine; asyncio callers stream from it.

    asyncio side (any event loop)             owner thread
    ---------------------------------         -------------------------------------------------
    submit(rid, ids, params) ---- inbox --->  pending FIFO --(ledger fits?)--> engine.add_request
    abort(rid) / set_grant / call(fn) ---->   applied between steps
    export_sessions(max_bytes, s) -------->   between steps: the cached prefix of each session's
                                              last token sequence (``sessions.SessionTable``)
    RequestStream (asyncio.Queue)  <-------   engine.step() events, one call_soon_threadsafe per
                                              event loop per step
    snapshot (a frozen dataclass)  <-------   published every snapshot_interval_s

``engine.step()`` is blocking numpy / ONNX Runtime work, so nothing else ever touches the
engine: every command reaches it through the inbox. ``launch`` builds the engine on the owner
thread itself: ONNX Runtime's CUDA provider keeps captured CUDA graphs (and its cuBLAS / cuDNN
handles) per thread, so graphs captured on another thread are not found by the owner's runs,
which capture each one again on its first live step (on the H200: 45-90 ms stalls, one per new
shape, in every replica whose engine was built on its main thread).

A request waits in ``pending`` until its worst-case footprint fits the replica's grant (see
``admission``), so a burst queues and the engine never has to preempt. Closing a stream before
its end aborts the request, which frees its blocks and state row at once.

The first event with tokens of each request carries how long it queued (receipt to admission)
and prefilled (admission to that event), for /metrics. ``status`` lists the owner thread's latest
stalls (``Stall``: a turn of at least STALL_MIN_S and STALL_FACTOR x the average step), each
split into what the turn did, so a stall on live traffic can be placed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import queue
import resource
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from mtpserve.actors.handover import Records, records_size
from mtpserve.actors.sessions import SessionTable
from mtpserve.engine.admission import Footprint, ReservationLedger, check_request
from mtpserve.engine.draft_policy import AdaptiveDraftPolicy
from mtpserve.engine.request import FinishReason, TokenEvent
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.speculative import SpecDecodeStats


class Overloaded(RuntimeError):
    """Too many requests are already waiting on this replica (HTTP 429)."""


STALL_MIN_S = 0.025                 # an owner-thread turn at least this long, and
STALL_FACTOR = 4.0                  # this many times the steps' average, is kept as a stall
MAX_STALLS = 32                     # the latest ones, in ``status``
MAX_ROUTING_DIGESTS = 4096          # prefix-cache digests a replica reports to routers (8 bytes each)
ROUTING_INDEX_INTERVAL_S = 0.2      # the routing index is rebuilt at most this often (when it changed)


class EngineFailed(RuntimeError):
    """The engine raised during a step; this replica must be restarted (HTTP 503)."""


@dataclass(frozen=True)
class LoopSnapshot:
    """What the owner thread last published: pools, ledger, queues, acceptance, counters."""
    num_usable_blocks: int = 0
    num_free_blocks: int = 0
    num_rows: int = 0
    num_free_rows: int = 0
    num_blocks_granted: int = 0
    num_rows_granted: int = 0
    num_reserved_blocks: int = 0
    num_reserved_rows: int = 0
    peak_reserved_blocks: int = 0
    peak_reserved_rows: int = 0
    num_running: int = 0
    num_pending: int = 0
    max_pending_seen: int = 0
    sessions: tuple[str, ...] = ()
    acceptance: dict[str, tuple[float, int]] = field(default_factory=dict)
    draft_cost: float | None = None    # measured cost of a draft level, in plain decode steps
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    num_steps: int = 0
    num_overlapped_steps: int = 0      # steps launched before the one they follow landed (engine/pipeline.py)
    step_time_ema_s: float = 0.0
    prefix_cache_queries: int = 0      # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0         # of which served from it
    prefix_cache_blocks: int = 0       # KV blocks the cache holds
    prefix_cache_snapshots: int = 0    # state snapshots it holds
    prefix_index: bytes = b""          # the cache's routing index (``PrefixCache.routing_index``)
    prefix_index_version: int = 0      # changes whenever prefix_index does
    failed: str | None = None
    taken_at: float = 0.0

    @property
    def load(self) -> float:
        """Resident requests / state rows; 1.0 as soon as anything waits for admission."""
        if self.num_pending:
            return 1.0
        return self.num_reserved_rows / self.num_rows_granted if self.num_rows_granted else 1.0


@dataclass(frozen=True)
class Stall:
    """A turn of the owner thread (commands, admission, one step, a snapshot) much longer than
    its steps take on average: every running request's next token waited for it. What it spent
    the time on, and the step it ran."""
    at_s: float             # when the turn began, seconds after the loop started
    turn_ms: float
    commands_ms: float      # the inbox's commands (adds, aborts, calls)
    admit_ms: float         # admitting queued requests (engine.add_request)
    step_ms: float          # the step: the engine's, then handing its events out (``dispatch_ms``)
    dispatch_ms: float
    publish_ms: float       # the snapshot
    gc_ms: float            # of the turn, in Python's garbage collector (any thread's collection)
    cpu_ms: float           # the owner thread's own CPU time in the turn: near turn_ms when it ran or
                            # spun (on the device: waiting on the GPU), near 0 when it was off the CPU
                            # (blocked on the GIL or a lock, or not scheduled)
    involuntary_switches: int   # times the kernel took the CPU from the owner thread in the turn
    num_admitted: int
    num_requests: int       # the step's requests, fed tokens, prompt chunk or not, replayed or not
    num_tokens: int
    prefill: bool
    graphed: bool
    phases_ms: dict[str, float] | None = None   # with stall_phases: the step's phases, largest first


class RequestStream:
    """One request's TokenEvents as an async iterator; ends after the finishing event.

    A reader that falls behind gets the events waiting for it as one (``merge_events``): under
    load the replica then writes one chunk per read instead of one per step (vLLM's output
    collector does the same), so serving keeps up with the engine instead of queueing behind it.
    ``pace``, when set, gives the least seconds between two reads: a read that comes sooner
    first waits out the rest, so the steps' events in between arrive as one (fewer, larger
    chunks where each chunk costs a message of its own: Serve's proxy path).
    """

    def __init__(self, request_id: str, loop_owner):
        self.request_id = request_id
        self._owner = loop_owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._held = None                  # an error that arrived behind merged events: next read
        self.event_loop = asyncio.get_running_loop()
        self.finished = False
        self.pace: Callable[[], float] | None = None   # the least seconds between two reads
        self._read_at: float | None = None
        self.counts_prompt = True          # its prompt's tokens count in /metrics (a prompt's first choice)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        if self.pace is not None and self._read_at is not None and self._held is None:
            wait = self._read_at + self.pace() - self.event_loop.time()
            if wait > 0:
                await asyncio.sleep(wait)          # the events of the steps meanwhile come as one
        item, self._held = (self._held, None) if self._held is not None else (await self._queue.get(), None)
        while not isinstance(item, BaseException) and item.finish_reason is None and not self._queue.empty():
            later = self._queue.get_nowait()
            if isinstance(later, BaseException):
                self._held = later
                break
            item = merge_events(item, later)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        if self.pace is not None:
            self._read_at = self.event_loop.time()
        return item

    def put(self, item) -> None:
        self._queue.put_nowait(item)

    def cancel(self) -> None:
        """Stop reading: abort the request unless it has already finished."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


def merge_events(first: TokenEvent, then: TokenEvent) -> TokenEvent:
    """Two consecutive events of one request as one: tokens, text and logprobs joined, the
    later one's end and counts (the first's prompt logprobs, which only a first event has)."""
    logprobs = None if first.logprobs is None and then.logprobs is None else \
        (first.logprobs or []) + (then.logprobs or [])
    timed = first if first.queue_s is not None else then
    return TokenEvent(first.request_id, first.token_ids + then.token_ids, first.text + then.text,
                      then.finish_reason, then.num_prompt_tokens or first.num_prompt_tokens,
                      then.num_output_tokens, then.num_cached_tokens or first.num_cached_tokens, logprobs,
                      first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs,
                      timed.queue_s, timed.prefill_s)


@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    footprint: Footprint
    stream: RequestStream
    session_id: str | None
    arrived_at: float = field(default_factory=time.monotonic)   # when this loop got it (submit, add_remote)


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    reply: Callable[[Any, BaseException | None], None]   # (result, error), called on the owner thread


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _SetGrant:
    num_blocks: int
    num_rows: int


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass
class _AddAll:
    """Requests that arrive together (one HTTP request's prompts x choices): one command, so the
    owner thread sees all or none of them before a step and they are scheduled alike."""
    adds: list[_Add]


Command = _Add | _AddAll | _Call | _Abort | _SetGrant | _Stop     # what the inbox carries


class EngineLoop:
    """Owns an ``Engine`` on a thread of its own; see the module docstring."""

    def __init__(self, engine, max_pending: int = 1024, snapshot_interval_s: float = 0.05,
                 session_ttl_s: float = 600.0, stall_phases: bool = False):
        """``stall_phases``: time every step by phase (``engine.phase_timers``), so that each
        stall says where its step's time went (a diagnostic: the timers cost microseconds a phase)."""
        self.engine = engine
        self.phase_timers = None
        if stall_phases:
            from mtpserve.engine.phase_timers import PhaseTimers
            self.phase_timers = PhaseTimers(engine, keep_steps=False)
        policy = engine.draft_policy
        self.policy = policy if isinstance(policy, AdaptiveDraftPolicy) else None   # reported to the planner
        self.max_pending = max_pending
        self.snapshot_interval_s = snapshot_interval_s
        self.limits, self.manifest, self.max_drafts = engine.limits, engine.manifest, engine.max_drafts
        self.num_usable_blocks = engine.limits.num_usable_blocks
        self.num_rows = engine.state_bank.num_request_rows
        self.ledger = ReservationLedger(self.num_usable_blocks, self.num_rows)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: deque[_Add] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._admitted: dict[str, tuple[float, float]] = {}   # no token yet: (seconds queued, admitted at)
        self.sessions = SessionTable(session_ttl_s)
        self._num_queued = 0                          # submitted, not yet admitted or dropped
        self._queued_lock = threading.Lock()
        self._max_pending_seen = 0
        self._step_time_ema = 0.0
        self._failed: BaseException | None = None
        self._published_at = 0.0
        self._started_at = time.perf_counter()          # the stalls' clock
        self.stalls: deque[Stall] = deque(maxlen=MAX_STALLS)   # the latest (see ``Stall``)
        self.num_stalls = 0
        self._gc = _GcClock()
        self._index = (b"", 0, 0.0)                   # (routing index, its cache version, built at)
        self.snapshot = LoopSnapshot()
        self._thread = threading.Thread(target=self._run, name="mtpserve-engine", daemon=True)
        self._go = threading.Event()                  # ``start`` after ``launch``

    @classmethod
    def launch(cls, build_engine: Callable[[], Any], **options) -> EngineLoop:
        """Build the engine with ``build_engine()`` on a new owner thread (``options``: the
        constructor's); returns once it is built, or raises what building raised. ``start`` then
        runs the loop on that same thread. The way to start a CUDA engine's loop (see the module
        docstring)."""
        built: queue.SimpleQueue = queue.SimpleQueue()

        def owner() -> None:
            try:
                loop = cls(build_engine(), **options)
            except BaseException as e:
                built.put(e)
                return
            loop._thread = threading.current_thread()
            built.put(loop)
            loop._go.wait()
            loop._publish()
            loop._run()
        thread = threading.Thread(target=owner, name="mtpserve-engine", daemon=True)
        thread.start()
        loop = built.get()
        if isinstance(loop, BaseException):
            thread.join()
            raise loop
        return loop

    # ------------------------------------------------------------------ caller side (any thread)
    def start(self) -> EngineLoop:
        """Run the loop: on its owner thread, which ``launch`` already made (it built the engine)."""
        if self._thread.is_alive():
            self._go.set()
        else:
            self._publish()
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(_Stop())
        self._go.set()                                # a launched loop never started: it stops at once
        self._thread.join(timeout)
        self._gc.close()

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams,
               session_id: str | None = None) -> RequestStream:
        """Queue a request; call from a running event loop. Raises ValueError (bad request),
        Overloaded (queue full) or EngineFailed before anything is queued."""
        return self.submit_all([(request_id, token_ids, params)], session_id)[0]

    def submit_all(self, requests: list[tuple[str, list[int], SamplingParams]],
                   session_id: str | None = None) -> list[RequestStream]:
        """Queue several requests as one arrival, all or none (``submit``'s errors): the owner
        thread admits them from the same step on (a request's n choices start together)."""
        if self._failed is not None:
            raise EngineFailed(f"the engine failed: {self._failed!r}")
        footprints = [check_request(ids, params.max_tokens, self.limits, params) for _, ids, params in requests]
        if not all(self.ledger.fits_grant(f) for f in footprints):
            raise Overloaded("this replica is draining or its grant is too small for the request")
        with self._queued_lock:
            if self._num_queued + len(requests) > self.max_pending:
                raise Overloaded(f"{self._num_queued} requests are already waiting on this replica")
            self._num_queued += len(requests)
        adds = [_Add(rid, list(ids), params, footprint, RequestStream(rid, self), session_id)
                for (rid, ids, params), footprint in zip(requests, footprints)]
        self._inbox.put(_AddAll(adds))
        return [a.stream for a in adds]

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def set_grant(self, num_blocks: int, num_rows: int) -> None:
        self._inbox.put(_SetGrant(min(num_blocks, self.num_usable_blocks), min(num_rows, self.num_rows)))

    async def call(self, fn: Callable[[Any], Any]):
        """Run ``fn(engine)`` on the owner thread between steps; its result (or exception)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Call(fn, lambda result, error: loop.call_soon_threadsafe(_settle, future, result, error)))
        return await future

    async def status(self) -> dict:
        """Integrity of the pools and the ledger, checked between steps, and their figures."""
        return await self.call(lambda _: self.status_now())

    async def export_sessions(self, max_bytes: int, budget_s: float) -> list[tuple[str, Records]]:
        """The sessions' cached prefixes, for a hand-over (``export_sessions_now``, between steps)."""
        return await self.call(lambda _: self.export_sessions_now(max_bytes, budget_s))

    # ------------------------------------------------------------------ owner thread
    def _run(self) -> None:
        clock = time.perf_counter
        while True:
            busy = self.engine.has_work and self._failed is None
            commands = self._take_commands(block=not busy)
            t0, gc0, usage0 = clock(), self._gc.total, _thread_usage()
            for command in commands:
                if isinstance(command, _Stop):
                    self._fail_all(EngineFailed("the replica is shutting down"), stopping=True)
                    return
                self._apply(command)
            t1 = t2 = t3 = clock()
            stepped, admitted, dispatch_s = False, 0, 0.0
            if self._failed is None:
                admitted = self._admit()
                t2 = t3 = clock()
                if self.engine.has_work:
                    dispatch_s = self._step()
                    stepped, t3 = True, clock()
            if time.monotonic() - self._published_at >= self.snapshot_interval_s or not self.engine.has_work:
                self._publish()
            t4 = clock()
            if t4 - t0 >= max(STALL_MIN_S, STALL_FACTOR * self._step_time_ema) and self._step_time_ema:
                self._note_stall(t0, t1, t2, t3, t4, admitted, stepped, dispatch_s, self._gc.total - gc0, usage0)

    def _note_stall(self, t0, t1, t2, t3, t4, admitted: int, stepped: bool, dispatch_s: float, gc_s: float,
                    usage0: resource.struct_rusage) -> None:
        last = self.engine.last_step if stepped else None
        usage = _thread_usage()
        cpu_s = usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime
        self.num_stalls += 1
        self.stalls.append(Stall(
            round(t0 - self._started_at, 4), *(round(1e3 * d, 3) for d in (
                t4 - t0, t1 - t0, t2 - t1, t3 - t2, dispatch_s, t4 - t3, gc_s, cpu_s)),
            usage.ru_nivcsw - usage0.ru_nivcsw, admitted,
            last.num_requests if last else 0, last.num_main_tokens if last else 0,
            bool(last and last.has_prefill), bool(last and last.graphed),
            None if self.phase_timers is None or not stepped else
            {k: round(1e3 * v, 3) for k, v in sorted(self.phase_timers.last.items(), key=lambda kv: -kv[1])
             if k != "step"}))

    def _take_commands(self, block: bool) -> list[Command]:
        """Everything in the inbox; when idle, first wait (a while) for something to arrive."""
        commands = []
        if block:
            try:
                commands.append(self._inbox.get(timeout=self.snapshot_interval_s * 4))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: Command) -> None:
        if isinstance(command, _AddAll):
            for add in command.adds:
                self._apply(add)
        elif isinstance(command, _Add):
            if self._failed is not None:
                self._dequeued(command.stream)
                self._deliver([(command.stream, EngineFailed(f"the engine failed: {self._failed!r}"))])
                return
            self._pending.append(command)
            self._max_pending_seen = max(self._max_pending_seen, len(self._pending))
            if command.session_id:
                self.sessions.start(command.request_id, command.session_id, command.token_ids, time.monotonic())
        elif isinstance(command, _Call):
            try:
                result, error = command.fn(self.engine), None
            except Exception as e:  # handed back to the caller
                result, error = None, e
            command.reply(result, error)
        elif isinstance(command, _Abort):
            self._abort(command.request_id)
        elif isinstance(command, _SetGrant):
            self.ledger.set_grant(command.num_blocks, command.num_rows)

    def _admit(self) -> int:
        """Admit queued requests, oldest first, while the grant holds them; how many."""
        num = 0
        while self._pending and self.ledger.can_reserve(self._pending[0].footprint):
            num += 1
            add = self._pending.popleft()
            self._dequeued(add.stream)
            self.ledger.reserve(add.request_id, add.footprint)
            try:
                self.engine.add_request(add.request_id, add.token_ids, add.params, continues=bool(add.session_id))
            except ValueError as e:
                self._finish_bookkeeping(add.request_id)
                self._deliver([(add.stream, e)])
                continue
            self._streams[add.request_id] = add.stream
            now = time.monotonic()
            self._admitted[add.request_id] = (now - add.arrived_at, now)
        return num

    def _step(self) -> float:
        """One engine step and its events handed out; the seconds the hand-out took (0 on failure)."""
        try:
            events = self.engine.step()
        except Exception as e:  # the engine's state is unknown now: fail everyone, stop stepping
            self._failed = e
            self._fail_all(EngineFailed(f"the engine failed during a step: {e!r}"))
            return 0.0
        timing = self.engine.last_step
        if timing is not None:
            ema = self._step_time_ema
            self._step_time_ema = timing.seconds if not ema else 0.9 * ema + 0.1 * timing.seconds
        started = time.perf_counter()
        self._dispatch(events)
        return time.perf_counter() - started

    def _dispatch(self, events: list[TokenEvent]) -> None:
        items = []
        for event in events:
            if event.token_ids and event.request_id in self._admitted:    # its first tokens: how long to them
                queued_s, admitted_at = self._admitted.pop(event.request_id)
                event = dataclasses.replace(event, queue_s=queued_s, prefill_s=time.monotonic() - admitted_at)
            stream = self._streams.get(event.request_id)
            self.sessions.extend(event.request_id, event.token_ids)
            if event.finish_reason is not None:
                self._streams.pop(event.request_id, None)
                self._finish_bookkeeping(event.request_id)
            if stream is not None:
                items.append((stream, event))
        if items:
            self._deliver(items)

    def _abort(self, request_id: str) -> None:
        for i, add in enumerate(self._pending):
            if add.request_id == request_id:
                del self._pending[i]
                self._dequeued(add.stream)
                self._finish_bookkeeping(request_id)
                event = TokenEvent(request_id, [], "", FinishReason.ABORT, len(add.token_ids), 0)
                self._deliver([(add.stream, event)])
                return
        event = self.engine.abort(request_id)
        if event is not None:
            self._dispatch([event])

    def _finish_bookkeeping(self, request_id: str) -> None:
        self._admitted.pop(request_id, None)
        self.ledger.release(request_id)
        self.sessions.finish(request_id)

    def _dequeued(self, stream) -> None:
        """A queued request left the queue (admitted, aborted or failed); ``stream``: its reader."""
        with self._queued_lock:
            self._num_queued -= 1

    def _fail_all(self, error: BaseException, stopping: bool = False) -> None:
        items = [(a.stream, error) for a in self._pending] + [(s, error) for s in self._streams.values()]
        for add in list(self._pending):
            self._dequeued(add.stream)
            self._finish_bookkeeping(add.request_id)
        self._pending.clear()
        for rid in list(self._streams):
            if stopping:
                self.engine.abort(rid)
            self._finish_bookkeeping(rid)
        self._streams.clear()
        self._publish()                       # before anyone hears of the failure
        if items:
            self._deliver(items)

    def status_now(self) -> dict:
        """``status`` on the owner thread: integrity ("ok" or what is broken) and pool figures."""
        engine = self.engine
        try:
            engine.check_integrity()
            self.ledger.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = str(e)
        return {"integrity": integrity, "idle_and_empty": engine.is_idle_and_empty(),
                "num_free_blocks": engine.kv_pool.num_free_blocks, "num_usable_blocks": engine.kv_pool.num_usable_blocks,
                "num_free_rows": engine.state_bank.num_free_rows, "num_rows": engine.state_bank.num_request_rows,
                "num_blocks_granted": self.ledger.num_blocks_granted,
                "peak_reserved_blocks": self.ledger.peak_reserved_blocks,
                "peak_reserved_rows": self.ledger.peak_reserved_rows,
                "max_pending_seen": self._max_pending_seen, "num_pending": len(self._pending),
                "spec": asdict(engine.stats), "owner_niceness": _niceness(),
                "built_on_owner_thread": engine.built_on_thread == threading.get_ident(), "num_stalls": self.num_stalls,
                "stalls": [asdict(s) for s in self.stalls]}

    def export_sessions_now(self, max_bytes: int, budget_s: float) -> list[tuple[str, Records]]:
        """On the owner thread: (session, ``Engine.export_prefix`` of its last token sequence), the
        most recently used session first, those with a cached prefix only, at most ``max_bytes`` of
        records in all (a session that does not fit is skipped), until ``budget_s`` has passed."""
        deadline = time.monotonic() + budget_s
        out, num_bytes = [], 0
        for session_id, tokens in self.sessions.last_sequences():
            if time.monotonic() > deadline:
                break
            records = self.engine.export_prefix(tokens)
            size = records_size(records)
            if records and num_bytes + size <= max_bytes:
                out.append((session_id, records))
                num_bytes += size
        return out

    def _deliver(self, items: list) -> None:
        """Hand (stream, event-or-exception) pairs to their readers: one wake-up per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.event_loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            _wake(batch, loop)

    def _publish(self) -> None:
        now = time.monotonic()
        self.sessions.prune(now)
        e, ledger = self.engine, self.ledger
        cache = e.prefix_cache
        prefix = {} if cache is None else dict(
            prefix_cache_queries=cache.stats.queries, prefix_cache_hits=cache.stats.hits,
            prefix_cache_blocks=e.kv_pool.num_cached_blocks, prefix_cache_snapshots=cache.num_snapshots,
            **self._routing_index(cache, now))
        self.snapshot = LoopSnapshot(
            num_usable_blocks=self.num_usable_blocks, num_free_blocks=e.kv_pool.num_free_blocks,
            num_rows=self.num_rows, num_free_rows=e.state_bank.num_free_rows,
            num_blocks_granted=ledger.num_blocks_granted, num_rows_granted=ledger.num_rows_granted,
            num_reserved_blocks=ledger.num_reserved_blocks, num_reserved_rows=ledger.num_reserved_rows,
            peak_reserved_blocks=ledger.peak_reserved_blocks, peak_reserved_rows=ledger.peak_reserved_rows,
            num_running=len(e.scheduler.requests), num_pending=len(self._pending),
            max_pending_seen=self._max_pending_seen, sessions=self.sessions.session_ids,
            acceptance=self.policy.acceptance() if self.policy is not None else {},
            draft_cost=self.policy.draft_cost() if self.policy is not None else None,
            spec=SpecDecodeStats().merged(e.stats), num_steps=e.num_steps, num_overlapped_steps=e.num_continuations,
            step_time_ema_s=self._step_time_ema, **prefix,
            failed=None if self._failed is None else repr(self._failed), taken_at=time.time())
        self._published_at = now


    def _routing_index(self, cache, now: float) -> dict:
        """The cache's routing index, rebuilt when it changed but at most every ROUTING_INDEX_INTERVAL_S."""
        index, version, built_at = self._index
        if cache.routing_version != version and now - built_at >= ROUTING_INDEX_INTERVAL_S:
            index, version = cache.routing_index(MAX_ROUTING_DIGESTS), cache.routing_version
            self._index = (index, version, now)
        return {"prefix_index": index, "prefix_index_version": version}


def _thread_usage() -> resource.struct_rusage:
    """The calling thread's CPU time and context switches so far (Linux's RUSAGE_THREAD; the
    process's elsewhere)."""
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))


def _niceness() -> int | None:
    """The calling thread's nice value (Linux: each thread has its own), or None where unknown."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (OSError, AttributeError):
        return None


class _GcClock:
    """Seconds this process has spent in Python's garbage collector since it was made (``gc.callbacks``)."""

    def __init__(self):
        self.total, self._began = 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.total += time.perf_counter() - self._began
            self._began = None

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _wake(items: list, loop: asyncio.AbstractEventLoop) -> None:
    """Hand (stream, event-or-exception) pairs to their event loop in one wake-up."""
    def put_all():
        for stream, item in items:
            stream.put(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # that event loop is closed: its callers are gone
        pass


async def merge_streams(streams: list[RequestStream]):
    """Yield (index, event) from several streams as events arrive; cancels them all on exit."""
    try:
        if len(streams) == 1:
            async for event in streams[0]:
                yield 0, event
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream):
            try:
                async for event in stream:
                    merged.put_nowait((i, event))
            except Exception as e:
                merged.put_nowait((i, e))
            merged.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            num_open = len(streams)
            while num_open:
                i, item = await merged.get()
                if item is None:
                    num_open -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.cancel()
