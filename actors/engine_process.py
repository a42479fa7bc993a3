"""The engine in a process of its own: the replica's serving and the engine's steps stop sharing a GIL.

    replica process (HTTP, Serve, asyncio)             engine process (python -m ...engine_process)
    ------------------------------------------         ------------------------------------------------
    EngineProcess.submit_all / abort / set_grant ----> command thread -> EngineLoop inbox (unchanged)
    call(fn) / status() / export_sessions /
      policy.set_plan ------------------------------>  applied between steps
    RequestStream (asyncio.Queue) <--- reader  <-----  one message per step: every request's events,
      thread: one wake-up per event loop per message   then snapshots, call replies, the dequeued count

One duplex ``multiprocessing`` pipe (a Unix socket pair handed to the child as a file descriptor,
pickled messages) joins the two. With ``num_clients``, the child gets that many more pipes, whose
other ends (``client_conns``) go to the replica's API-server processes (``actors/api_servers.py``):
each attaches (``EngineProcess.attach``) and submits, aborts and calls over its own pipe, and gets
its own requests' events, every snapshot and its own replies; only the replica's pipe sets the
grant and the draft plan, and its closing stops the engine (an API server's aborts its requests).
The caller side has ``EngineLoop``'s interface, so the replica uses either. Why: on the H200 the
replica's event loop, Serve's own loop and the engine thread held one GIL; at 16 streams the
engine thread got a fifth of it and each step took about twice its in-process time (py-spy --gil,
results/h200/serving/).

Failures: an engine that cannot start raises in ``start`` with the child's traceback; an engine
process that dies fails every open stream with ``EngineFailed`` and refuses new requests (the
replica's health check then fails and Serve replaces it); a replica that dies closes the socket and
the engine process stops on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

from mtpserve.actors.engine_loop import (
    EngineFailed,
    EngineLoop,
    LoopSnapshot,
    Overloaded,
    RequestStream,
    _Add,
    _AddAll,
    _Call,
    _settle,
    _wake,
)
from mtpserve.actors.handover import Records
from mtpserve.engine.admission import ReservationLedger, check_request
from mtpserve.engine.request import FinishReason, TokenEvent
from mtpserve.engine.sampler import SamplingParams


class EngineProcess:
    """An ``EngineLoop`` in a child process, driven from this one; see the module docstring.

    ``limits``, ``max_drafts``, ``num_usable_blocks``, ``num_rows`` and ``manifest`` come from the
    child once its engine is built; ``policy`` forwards the planner's plan when the engine's draft
    policy is adaptive (None otherwise).
    """

    def __init__(self, config, max_pending: int = 1024, snapshot_interval_s: float = 0.05,
                 start_timeout_s: float = 1800.0, num_clients: int = 0, stall_phases: bool = False):
        self.config = config
        self.stall_phases = stall_phases
        self.num_clients = num_clients
        self.client_conns: list[Connection] = []  # the other ends of the API servers' pipes (``attach``)
        self.info: dict = {}                      # what the engine process said when ready
        self.peer_metrics: dict = {}              # the other pipes' latest MetricsSnapshot, by pipe
        self._attached = False
        self.max_pending = max_pending
        self.snapshot_interval_s = snapshot_interval_s
        self.start_timeout_s = start_timeout_s
        self.snapshot = LoopSnapshot()
        self.policy: _PolicyProxy | None = None
        self._failed: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()             # streams, calls, counts; and one sender at a time
        self._num_submitted = 0
        self._num_dequeued = 0                    # the child's count: admitted or dropped from its queue
        self._grant: ReservationLedger | None = None    # the grant's mirror: what could ever be admitted
        self._stopping = False
        self._conn: Connection | None = None
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineProcess:
        """Spawn the engine process and wait until its engine is ready (RuntimeError if it fails)."""
        self._conn, theirs = Pipe(duplex=True)            # a Unix socket pair: private to the two
        clients = [Pipe(duplex=True) for _ in range(self.num_clients)]
        fds = [theirs.fileno()] + [child_end.fileno() for _, child_end in clients]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen([sys.executable, "-m", "mtpserve.actors.engine_process", ",".join(map(str, fds))],
                                      env=env, stdin=subprocess.DEVNULL, pass_fds=fds)
        theirs.close()
        for _, child_end in clients:
            child_end.close()
        self.client_conns = [ours for ours, _ in clients]
        self._conn.send(("config", self.config, self.max_pending, self.snapshot_interval_s, self.stall_phases))
        deadline = time.monotonic() + self.start_timeout_s
        while not self._conn.poll(1.0):
            if self._proc.poll() is not None:
                raise RuntimeError(f"the engine process exited with code {self._proc.returncode} while starting")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the engine process was not ready within {self.start_timeout_s:g} s")
        kind, info = self._conn.recv()
        if kind != "ready":
            self._proc.wait(timeout=30)
            raise RuntimeError(f"the engine could not start in its process: {info}")
        self._ready(info)
        self.policy = _PolicyProxy(self) if info["adaptive"] else None
        return self

    @classmethod
    def attach(cls, conn: Connection, info: dict, max_pending: int = 1024) -> EngineProcess:
        """A client of an engine process that another process started (one of ``client_conns``
        and that process's ``info``): an API server's. Requests, aborts and calls as ``start``'s;
        the grant follows the engine's snapshots; no plan, and ``stop`` leaves the engine running."""
        self = cls(None, max_pending)
        self._conn, self._attached = conn, True
        self._ready(info)
        return self

    def _ready(self, info: dict) -> None:
        self.info = info
        self.limits, self.max_drafts = info["limits"], info["max_drafts"]
        self.num_usable_blocks, self.num_rows = info["num_usable_blocks"], info["num_rows"]
        self.manifest, self.snapshot = info["manifest"], info["snapshot"]
        self._grant = ReservationLedger(self.num_usable_blocks, self.num_rows)
        self._reader = threading.Thread(target=self._read, name="mtpserve-engine-reader", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine process (its open requests end with EngineFailed) and wait for it."""
        self._stopping = True
        if self._attached:
            return                                 # the engine is its starter's to stop
        try:
            self._send(("stop",))
        except (OSError, EngineFailed):
            pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._reader is not None:
            self._reader.join(timeout)

    @property
    def failed(self) -> BaseException | None:
        """Set once the engine failed in a step (the child's snapshot says so) or its process ended."""
        if self._failed is None and self.snapshot.failed is not None:
            self._failed = EngineFailed(f"the engine failed during a step: {self.snapshot.failed}")
        return self._failed

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # ------------------------------------------------------------------ caller side (EngineLoop's)
    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams,
               session_id: str | None = None) -> RequestStream:
        return self.submit_all([(request_id, token_ids, params)], session_id)[0]

    def submit_all(self, requests: list[tuple[str, list[int], SamplingParams]],
                   session_id: str | None = None) -> list[RequestStream]:
        """As ``EngineLoop.submit_all``: all or none; ValueError, Overloaded or EngineFailed first."""
        if self.failed is not None:
            raise EngineFailed(f"the engine failed: {self._failed!r}")
        footprints = [check_request(ids, params.max_tokens, self.limits, params) for _, ids, params in requests]
        if not all(self._grant.fits_grant(f) for f in footprints):
            raise Overloaded("this replica is draining or its grant is too small for the request")
        streams = [RequestStream(rid, self) for rid, _, _ in requests]
        with self._lock:
            queued = self._num_submitted - self._num_dequeued
            if queued + len(requests) > self.max_pending:
                raise Overloaded(f"{queued} requests are already waiting on this replica")
            self._num_submitted += len(requests)
            self._streams.update((s.request_id, s) for s in streams)
            self._send_locked(("add", [(rid, list(ids), params) for rid, ids, params in requests], session_id))
        return streams

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except (OSError, EngineFailed):
            pass                                   # the process is gone: nothing left to free

    def set_grant(self, num_blocks: int, num_rows: int) -> None:
        num_blocks, num_rows = min(num_blocks, self.num_usable_blocks), min(num_rows, self.num_rows)
        self._grant.set_grant(num_blocks, num_rows)
        self._send(("grant", num_blocks, num_rows))

    async def call(self, fn: Callable[[Any], Any]):
        """Run ``fn(engine)`` in the engine process between steps; fn and its result are pickled."""
        return await self._ask("call", fn)

    async def status(self) -> dict:
        """``EngineLoop.status`` of the engine process, plus its pid."""
        return {**await self._ask("status", None), "engine_pid": self.pid}

    async def export_sessions(self, max_bytes: int, budget_s: float) -> list[tuple[str, Records]]:
        """``EngineLoop.export_sessions`` in the engine process (the records come back pickled)."""
        return await self._ask("export_sessions", (max_bytes, budget_s))

    def send_metrics(self, snapshot) -> None:
        """This process's request metrics (a ``MetricsSnapshot``), for the other pipes' ``peer_metrics``."""
        try:
            self._send(("metrics", snapshot))
        except (OSError, EngineFailed):
            pass

    async def _ask(self, kind: str, payload):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self.failed is not None:
                raise EngineFailed(f"the engine failed: {self._failed!r}")
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, future)
            self._send_locked((kind, call_id, payload))
        return await future

    def _send(self, message) -> None:
        with self._lock:
            self._send_locked(message)

    def _send_locked(self, message) -> None:
        if self._conn is None:
            raise EngineFailed("the engine process is not running")
        try:
            self._conn.send(message)
        except OSError as e:          # it died, and the reader has not seen its socket close yet
            raise EngineFailed(f"the engine process is gone ({e!r})") from None

    # ------------------------------------------------------------------ reader thread
    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "events":
                self._dispatch(message[1], message[2])
            elif kind == "snapshot":
                snapshot = message[1]
                if snapshot.prefix_index_version == self.snapshot.prefix_index_version:   # sent only when changed
                    snapshot = dataclasses.replace(snapshot, prefix_index=self.snapshot.prefix_index)
                self.snapshot, self._num_dequeued, self.peer_metrics = snapshot, message[2], message[3]
                if self._attached:                 # the grant is the replica's: its mirror follows
                    self._grant.set_grant(snapshot.num_blocks_granted, snapshot.num_rows_granted)
            elif kind == "reply":
                with self._lock:
                    loop, future = self._calls.pop(message[1], (None, None))
                if loop is not None:
                    loop.call_soon_threadsafe(_settle, future, message[2], message[3])
        code = self._proc.wait() if self._proc is not None else None
        error = EngineFailed("the replica is shutting down" if self._stopping else
                             f"the engine process exited (exit code {code})")
        self._failed = self._failed or error
        with self._lock:
            streams, calls = list(self._streams.values()), list(self._calls.values())
            self._streams.clear()
            self._calls.clear()
        self._wake_all([(s, error) for s in streams])
        for loop, future in calls:
            loop.call_soon_threadsafe(_settle, future, None, error)

    def _dispatch(self, items: list[tuple[str, Any]], num_dequeued: int) -> None:
        pairs = []
        items = [(rid, event_from_wire(item) if type(item) is tuple else item) for rid, item in items]
        with self._lock:                          # (the events built outside it: submit_all waits on it)
            self._num_dequeued = num_dequeued
            for request_id, item in items:
                final = isinstance(item, BaseException) or item.finish_reason is not None
                stream = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
                if stream is not None:
                    pairs.append((stream, item))
        self._wake_all(pairs)

    @staticmethod
    def _wake_all(pairs: list) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in pairs:
            by_loop.setdefault(stream.event_loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            _wake(batch, loop)


class _PolicyProxy:
    """The adaptive draft policy's planner inputs, forwarded to the engine process."""

    def __init__(self, owner: EngineProcess):
        self._owner = owner

    def set_plan(self, *args) -> None:
        self._owner._send(("policy", "set_plan", args))


def event_to_wire(e: TokenEvent) -> tuple:
    """A TokenEvent as a plain tuple for the pipe: a step's events pickle (and unpickle) about
    four times faster than as dataclasses (16 events: 3.6 vs 15.7 us each way on this CPU); the
    engine process pickles them on its step path, the replica unpickles them under its GIL."""
    return (e.request_id, e.token_ids, e.text, None if e.finish_reason is None else e.finish_reason.value,
            e.num_prompt_tokens, e.num_output_tokens, e.num_cached_tokens, e.logprobs, e.prompt_logprobs,
            e.queue_s, e.prefill_s)


def event_from_wire(t: tuple) -> TokenEvent:
    """``event_to_wire``'s tuple as the TokenEvent it was."""
    rid, ids, text, finish, *rest = t
    return TokenEvent(rid, ids, text, None if finish is None else FinishReason(finish), *rest)


# ---------------------------------------------------------------------- the engine process
class _RemoteStream:
    """A request's stand-in in the engine process: its events go back over ``conn``."""
    __slots__ = ("request_id", "conn")

    def __init__(self, request_id: str, conn: Connection):
        self.request_id, self.conn = request_id, conn


class _ChildLoop(EngineLoop):
    """``EngineLoop`` whose deliveries, snapshots and replies are messages to the replica (its
    pipe first in ``conns``) and its API servers (the rest)."""

    def __init__(self, engine, conns: list[Connection], max_pending: int, snapshot_interval_s: float,
                 stall_phases: bool = False):
        self._conns = list(conns)
        self._send_lock = threading.Lock()
        self.num_dequeued = dict.fromkeys(conns, 0)   # each pipe's requests that left the queue
        self.metrics: dict[int, object] = {}          # pipe index -> its process's latest MetricsSnapshot
        self._index_of = {conn: i for i, conn in enumerate(conns)}
        self._index_version_sent = -1        # the routing index goes out only when it changed
        super().__init__(engine, max_pending, snapshot_interval_s, stall_phases=stall_phases)

    def send(self, message, conn: Connection) -> None:
        with self._send_lock:
            try:
                conn.send(message)
            except OSError:
                pass                               # that end is gone: the command thread sees it close

    def add_remote(self, requests: list[tuple[str, list[int], SamplingParams]], session_id: str | None,
                   conn: Connection) -> None:
        adds = []
        for rid, ids, params in requests:
            stream = _RemoteStream(rid, conn)
            try:
                footprint = check_request(ids, params.max_tokens, self.limits, params)
                if params.grammar is not None:     # compiled here, on the command thread, not between steps
                    self.engine.grammars.compiler.compile(params.grammar)
            except ValueError as e:                # the replica checked this already; never silent
                self._dequeued(stream)
                self.send(("events", [(rid, e)], self.num_dequeued[conn]), conn)
                continue
            adds.append(_Add(rid, ids, params, footprint, stream, session_id))
        with self._queued_lock:
            self._num_queued += len(adds)
        self._inbox.put(_AddAll(adds))

    def drop_client(self, conn: Connection) -> None:
        """An API server's pipe closed (it exited): its requests are aborted between steps."""
        with self._send_lock:
            self._conns.remove(conn)

        def abort_theirs(_):
            rids = [rid for rid, s in self._streams.items() if s.conn is conn]
            for rid in rids + [a.request_id for a in self._pending if a.stream.conn is conn]:
                self._abort(rid)
        self._inbox.put(_Call(abort_theirs, lambda result, error: None))

    def _deliver(self, items: list) -> None:
        by_conn: dict[Connection, list] = {}
        for stream, item in items:
            by_conn.setdefault(stream.conn, []).append(
                (stream.request_id, event_to_wire(item) if type(item) is TokenEvent else item))
        for conn, batch in by_conn.items():
            self.send(("events", batch, self.num_dequeued[conn]), conn)

    def _dequeued(self, stream: _RemoteStream) -> None:
        super()._dequeued(stream)
        with self._queued_lock:
            self.num_dequeued[stream.conn] += 1

    def _publish(self) -> None:
        super()._publish()
        snapshot = self.snapshot
        if snapshot.prefix_index_version == self._index_version_sent:     # the replica has this index
            snapshot = dataclasses.replace(snapshot, prefix_index=b"")
        self._index_version_sent = self.snapshot.prefix_index_version
        with self._send_lock:
            conns = list(self._conns)
        metrics = dict(self.metrics)
        for conn in conns:
            i = self._index_of[conn]
            self.send(("snapshot", snapshot, self.num_dequeued[conn], {j: m for j, m in metrics.items() if j != i}),
                      conn)


def _owner_call(loop: _ChildLoop, kind: str, payload) -> Callable[[Any], Any]:
    """What a call message runs on the owner thread: its fn(engine), the status, or a session export."""
    if kind == "call":
        return payload
    if kind == "status":
        return lambda _: loop.status_now()
    max_bytes, budget_s = payload
    return lambda _: loop.export_sessions_now(max_bytes, budget_s)


def run_at_normal_priority(what: str) -> None:
    """Bring this process back to nice 0 when it starts below it: Ray runs its workers at nice 15
    (its ``worker_niceness``), and this process inherits that from the replica's thread, below
    every ordinary process on the host. (The engine process's 45-93 ms steps on the H200 were not
    this, but ORT's per-thread CUDA graphs: see ``EngineLoop.launch``.) On Linux each thread has
    its own nice value and new threads inherit their starter's: every thread so far (those that
    imports started, such as BLAS pools) is set, and the ones started later follow. Where the host does
    not allow it (no CAP_SYS_NICE, RLIMIT_NICE), say so and go on."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            niceness = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:
            continue                               # a thread that ended meanwhile
        if niceness <= 0:
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        except PermissionError as e:
            print(f"mtpserve: {what} runs at nice {niceness} (Ray's worker niceness) and cannot go back to 0 "
                  f"({e}); start Ray with RAY_worker_niceness=0", file=sys.stderr, flush=True)
            return
        except OSError:
            continue                               # a thread that ended meanwhile


def _child_main(fds: str) -> int:
    run_at_normal_priority("the engine process")
    conns = [Connection(int(fd)) for fd in fds.split(",")]
    replica = conns[0]                             # the replica's pipe; the rest are its API servers'
    _, config, max_pending, snapshot_interval_s, stall_phases = replica.recv()

    def build_engine():
        from mtpserve.engine.engine import Engine
        engine = Engine(config)
        engine.grammars.compiler.preload()         # structured output's library, before serving
        return engine
    try:
        loop = _ChildLoop.launch(build_engine, conns=conns, max_pending=max_pending,
                                 snapshot_interval_s=snapshot_interval_s, stall_phases=stall_phases)
        gc.freeze()           # what start-up built lives as long as the process: no collection rescans it
    except BaseException as e:
        replica.send(("start_failed", f"{e!r}\n{traceback.format_exc()}"))
        return 1
    engine = loop.engine
    replica.send(("ready", {"limits": engine.limits, "max_drafts": engine.max_drafts, "manifest": engine.manifest,
                            "num_usable_blocks": loop.num_usable_blocks, "num_rows": loop.num_rows,
                            "adaptive": loop.policy is not None, "snapshot": loop.snapshot}))
    loop.start()
    open_conns = list(conns)
    while True:
        for conn in wait(open_conns) if len(open_conns) > 1 else open_conns:
            try:
                message = conn.recv()
            except (EOFError, OSError):            # that end is gone
                if conn is not replica:
                    open_conns.remove(conn)
                    loop.drop_client(conn)
                    continue
                message = ("stop",)
            kind = message[0]
            if kind == "add":
                loop.add_remote(message[1], message[2], conn)
            elif kind == "abort":
                loop.abort(message[1])
            elif kind == "metrics":
                loop.metrics[loop._index_of[conn]] = message[1]
            elif kind in ("call", "status", "export_sessions"):
                reply = (lambda cid, to: lambda result, error: loop.send(("reply", cid, result, error), to))(
                    message[1], conn)
                loop._inbox.put(_Call(_owner_call(loop, kind, message[2]), reply))
            elif conn is not replica:
                continue                           # the grant, the plan and stopping are the replica's
            elif kind == "grant":
                loop.set_grant(message[1], message[2])
            elif kind == "policy":
                if loop.policy is not None:
                    getattr(loop.policy, message[1])(*message[2])
            elif kind == "stop":
                loop.stop()
                return 0


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1]))
