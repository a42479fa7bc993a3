"""A steady draft step as one CUDA graph of ours: recorded once, launched for every later step
whose launches are the same (``EngineConfig.step_recordings``; CUDA, MTP engines: on by default there).

A steady draft continuation (the same requests as the draft step it follows, staged from it on
the device) makes ~20 device calls around three ORT replays: ~500 us of host time at 16
requests on an H100's host, and gaps on the GPU between them (a recorded step ran 754-781 us of
GPU time against 819 launched call by call, session 37). Here the step's host side runs in full
(staging into pinned blocks, the engine's bookkeeping) with its launches deferred
(``launches.deferring``); then, by the deferred calls' signature:

    host    stage + bookkeeping, launches deferred | signature | one graph launch
    device                                           recording: head catch-up, chained drafts,
                                                     verify, accept, commit, readback, events

  - a recording with that signature: it is launched (one call, ~30 us);
  - none, and the signature was seen before (``RECORD_AFTER``): the calls are recorded in a
    stream capture of ours (ORT's forwards run eagerly inside it, events become external event
    nodes: each launch records them where the step did), kept and launched (~2 ms of host time,
    once a signature: a signature seen once, e.g. a batch size that lasts one step while
    requests end, is not worth it);
  - the step left the deferrable path (an eager forward, a host read: ``launches.escape``), or
    allocated device memory (a recording would hold a temporary the pool hands out again), or
    the recordings are at their cap: its calls are queued as they are.

Why one signature is one step's work: a call's key holds every pointer and scalar the graph
bakes in (the function, its launch shape, its arguments). What varies from step to step outside
the keys the graph reads when it runs: the pinned host blocks (staging, the commit's index
block), which the host side rewrote before the launch, guarded by the same events as before.
ORT's eager forwards inside a recording use its arena's buffers as they were at the capture;
those hold nothing between runs (our bindings own every output). The probe
``results/h200/scripts/step_capture_probe.py --replay`` found 65 launches of 6 recordings at 16
requests (143 of 12 at one) token for token equal to an engine that never recorded.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import onnxruntime as ort

from mtpserve.engine import launches

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_RECORDINGS = 64         # signatures kept (batch sizes x what alternates step to step x table uploads)
RECORD_AFTER = 2            # a signature is recorded the RECORD_AFTER-th time it is seen
MAX_SEEN = 4096             # signatures counted before the count starts again


@dataclass
class _Recording:
    graph: object                 # cupy.cuda.graph.Graph
    calls: list                   # the recorded calls: their arrays stay alive with the graph
    launches: int = 0


@dataclass
class StepRecordings:
    """The recordings of one engine's steady draft steps, by signature, and what they did."""
    max_recordings: int = MAX_RECORDINGS
    num_launched: int = 0         # steps launched as a recording (its first launch included)
    num_recorded: int = 0         # recordings made
    num_queued: int = 0           # deferred steps whose calls were queued as they were
    num_escaped: int = 0          # of those, steps that left the deferrable path
    num_allocating: int = 0       # of those, steps that allocated device memory
    num_host_staged: int = 0      # steps offered after one staged from the host (Engine.record_host_staged)
    record_seconds: float = 0.0
    disabled: str | None = None   # why recording stopped (a capture failed), if it did
    skipped: Counter = field(default_factory=Counter)     # draft steps not steady, by why (the engine counts)
    _recordings: dict = field(default_factory=dict, repr=False)
    _seen: dict = field(default_factory=dict, repr=False)        # signature -> times seen, unrecorded
    _eager: object = field(default=None, repr=False)

    def __post_init__(self):
        self._eager = ort.RunOptions()
        self._eager.add_run_config_entry("gpu_graph_id", "-1")       # ORT runs the binding eagerly
        self._eager.add_run_config_entry("disable_synchronize_execution_providers", "1")

    @property
    def num_recordings(self) -> int:
        return len(self._recordings)

    def launch(self, step: Callable[[], T]) -> T:
        """Run ``step`` (a draft step's launch: host side and device calls) with its device calls
        deferred, then launch them as a recording (see the module); ``step``'s result."""
        import cupy
        pool, allocations = cupy.get_default_memory_pool(), [0]

        def malloc(size: int):
            allocations[0] += 1
            return pool.malloc(size)
        with cupy.cuda.using_allocator(malloc), launches.deferring() as deferred:
            try:
                result = step()
            except BaseException:
                launches.run_calls(deferred.calls)       # (what the step queued so far still runs)
                raise
        recording = None
        if deferred.escaped or allocations[0] or self.disabled:
            self.num_escaped += deferred.escaped
            self.num_allocating += bool(allocations[0])
        else:
            key = deferred.signature()
            recording = self._recordings.get(key)
            if recording is None and len(self._recordings) < self.max_recordings:
                seen = self._seen.get(key, 0) + 1
                if seen >= RECORD_AFTER:
                    self._seen.pop(key, None)
                    recording = self._record(deferred.calls)
                    if recording is not None:
                        self._recordings[key] = recording
                else:
                    if len(self._seen) >= MAX_SEEN:
                        self._seen.clear()
                    self._seen[key] = seen
        if recording is None:
            launches.run_calls(deferred.calls)
            self.num_queued += 1
            return result
        recording.graph.launch(cupy.cuda.get_current_stream())
        recording.launches += 1
        self.num_launched += 1
        return result

    def _record(self, calls: list) -> _Recording | None:
        """``calls`` recorded in a stream capture of ours and uploaded, or None (recording off
        from then on, why in ``disabled``) when the capture fails; nothing of them has run."""
        import cupy
        stream = cupy.cuda.get_current_stream()
        started = time.perf_counter()
        try:
            stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
            try:
                launches.run_calls(calls, capture=True, eager_options=self._eager)
            finally:
                graph = stream.end_capture()
            if hasattr(graph, "upload"):
                graph.upload(stream)
        except Exception as e:   # noqa: BLE001 - the step's calls are queued as they are instead
            self.disabled = f"{type(e).__name__}: {e}"[:500]
            logger.warning("step recordings: a capture failed (%s); steps launch call by call from now on",
                           self.disabled)
            return None
        self.record_seconds += time.perf_counter() - started
        self.num_recorded += 1
        return _Recording(graph, list(calls))

    def stats(self) -> dict:
        return {"recordings": self.num_recordings, "launched": self.num_launched, "recorded": self.num_recorded,
                "queued": self.num_queued, "escaped": self.num_escaped, "allocating": self.num_allocating,
                "host_staged": self.num_host_staged,
                "record_s": round(self.record_seconds, 3), "disabled": self.disabled, "skipped": dict(self.skipped)}
