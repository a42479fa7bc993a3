"""The engine's device launches, queued on the current stream now or deferred into a list.

Every kernel, copy, event record and ORT graph replay a draft step makes on CUDA goes through
``kernel``, ``copy``, ``copy_2d``, ``record`` and ``replay`` here. Normally each is queued at
once. Inside ``deferring()`` (one thread's: each engine steps on its own) they are appended to a
``Deferred`` instead, with a key each that says everything the launch bakes into a CUDA graph
(the function, its launch shape, every pointer and scalar argument), so that a step's host side
(staging into pinned blocks, bookkeeping) runs in full while its launches wait:

    step's host side      stage  kernel  copy  replay  kernel  record  ...   (deferred)
    Deferred.calls        [  k0,    c1,    r2,    k3,     e4, ...]
    Deferred.signature()  what a recording of these calls was made from: equal signatures,
                          equal work (engine/step_recordings.py launches the recording)

``run_calls`` queues deferred calls as they would have been queued (``capture=False``), or
inside a stream capture of ours (``capture=True``): ORT's runs eager (its own captured graphs
cannot be launched inside another capture) and each event recorded as an external event node,
so that every launch of the recording records it where the step did. No GPU or CuPy import here
until a call is queued; on the CPU only ``escape`` is called (eager forwards, host reads), a
no-op outside ``deferring()``.
"""

from __future__ import annotations

import ctypes
import threading

KERNEL, COPY, COPY_2D, EVENT, REPLAY = range(5)

class _Local(threading.local):
    deferred: Deferred | None = None      # (a class default: no per-call getattr fallback on the hot path)


_local = _Local()


class Deferred:
    """One step's launches in order (``calls``) and their keys (``keys``, see the module);
    ``escaped``: the step left the deferrable path (``escape``), its launches were queued."""
    __slots__ = ("calls", "keys", "escaped", "_ndarray")

    def __init__(self, ndarray_type):
        self.calls: list[tuple] = []
        self.keys: list[tuple] = []
        self.escaped = False
        self._ndarray = ndarray_type

    def signature(self) -> tuple:
        return tuple(self.keys)


class deferring:
    """``with deferring() as d:`` the current thread's launches go to ``d`` (a ``Deferred``);
    ``ndarray_type``: the device array type whose arguments are keyed by pointer (CuPy's)."""

    def __init__(self, ndarray_type=None):
        self.ndarray_type = ndarray_type

    def __enter__(self) -> Deferred:
        if _local.deferred is not None:
            raise AssertionError("launches are deferred already on this thread")
        nd = self.ndarray_type
        if nd is None:
            import cupy
            nd = cupy.ndarray
        _local.deferred = Deferred(nd)
        return _local.deferred

    def __exit__(self, *exc) -> None:
        _local.deferred = None


def escape() -> None:
    """Where a step leaves the path whose launches can be deferred (an eager ORT forward, a host
    read of a device result, CuPy's own array code): inside ``deferring()`` the launches deferred
    so far are queued now, in order, and the rest of the step launches as it goes. A no-op
    otherwise."""
    d = _local.deferred
    if d is None:
        return
    _local.deferred = None
    d.escaped = True
    calls, d.calls = d.calls, []
    run_calls(calls)


def kernel(fn, grid: tuple, block: tuple, args: tuple) -> None:
    """``fn(grid, block, args)``: a CuPy RawKernel launch on the current stream."""
    d = _local.deferred
    if d is None:
        fn(grid, block, args)
        return
    d.calls.append((KERNEL, fn, grid, block, args))
    nd = d._ndarray
    d.keys.append((KERNEL, id(fn), grid, block, tuple(a.data.ptr if type(a) is nd else a for a in args)))


def copy(dst: int, src: int, nbytes: int, kind: int) -> None:
    """``cudaMemcpyAsync(dst, src, nbytes, kind)`` on the current stream (pointers as ints)."""
    d = _local.deferred
    if d is None:
        import cupy
        cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, cupy.cuda.get_current_stream().ptr)
        return
    call = (COPY, dst, src, nbytes, kind)
    d.calls.append(call)
    d.keys.append(call)


def copy_2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int) -> None:
    """``cudaMemcpy2DAsync`` on the current stream (pointers as ints)."""
    d = _local.deferred
    if d is None:
        import cupy
        cupy.cuda.runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind,
                                        cupy.cuda.get_current_stream().ptr)
        return
    call = (COPY_2D, dst, dpitch, src, spitch, width, height, kind)
    d.calls.append(call)
    d.keys.append(call)


def record(event) -> None:
    """``event.record(current stream)``: what guards a pinned block or a readback slot."""
    d = _local.deferred
    if d is None:
        import cupy
        event.record(cupy.cuda.get_current_stream())
        return
    d.calls.append((EVENT, event))
    d.keys.append((EVENT, id(event)))


def replay(graph_set, graph) -> None:
    """``graph.replay()``: ORT's replay of one captured forward (``cuda_graphs._Graph``)."""
    d = _local.deferred
    if d is None:
        graph.replay()
        return
    d.calls.append((REPLAY, graph_set, graph))
    d.keys.append((REPLAY, id(graph)))


def run_calls(calls: list[tuple], capture: bool = False, eager_options=None) -> None:
    """Queue deferred ``calls`` on the current stream in order. ``capture``: inside a stream
    capture of ours (the caller's), so ORT's forwards run eagerly with ``eager_options`` (graph
    id -1) and events are recorded as external event nodes."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    runtime = cupy.cuda.runtime
    for call in calls:
        kind = call[0]
        if kind == KERNEL:
            call[1](call[2], call[3], call[4])
        elif kind == COPY:
            runtime.memcpyAsync(call[1], call[2], call[3], call[4], stream.ptr)
        elif kind == COPY_2D:
            runtime.memcpy2DAsync(*call[1:], stream.ptr)
        elif kind == EVENT:
            if capture:
                record_external(call[1], stream)
            else:
                call[1].record(stream)
        elif capture:
            graph_set, graph = call[1], call[2]
            graph_set.session.run_with_iobinding(graph.binding.io, eager_options)
        else:
            call[2].replay()


_CU_EVENT_RECORD_EXTERNAL = 0x1
_driver = None


def record_external(event, stream) -> None:
    """Record ``event`` on a capturing ``stream`` as an external event node (the driver's
    ``cuEventRecordWithFlags``; CuPy has no binding for it): each launch of the graph records
    the event there, and the host can wait for it as for an eager record."""
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuEventRecordWithFlags.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
        lib.cuEventRecordWithFlags.restype = ctypes.c_int
        _driver = lib
    status = _driver.cuEventRecordWithFlags(event.ptr, stream.ptr, _CU_EVENT_RECORD_EXTERNAL)
    if status:
        raise RuntimeError(f"cuEventRecordWithFlags failed: CUresult {status}")
