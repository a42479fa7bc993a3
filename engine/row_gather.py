"""Rows gathered from several arrays into one, a gather per source array.

The head's catch-up reads each request's pending hidden rows: segments ``(array, start, count)``
of the hidden outputs of the steps since the request last drafted. Every step's output holds
all of that step's requests, so the segments of a batch share few arrays::

    segments, in output order             grouped by source array
    r0: A[3:4] B[3:4] C[3:4]              A: rows 0, 3, 6 <- A rows 3, 4, 5
    r1: A[4:5] B[4:5] C[4:5]      ->      B: rows 1, 4, 7 <- B rows 3, 4, 5
    r2: A[5:6] B[5:6] C[5:6]              C: rows 2, 5, 8 <- C rows 3, 4, 5

one gather a source array (3 launches here, and one copy of the row index to the device) where a
copy a segment made 9. On the device the gather is ``cuda_kernels.gather_rows``; numpy assigns
by the same index, so the CPU runs the plan the GPU runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

Array = Any   # numpy or cupy ndarray


def plan_gather(segments: Iterable[tuple[Array, int, int, int]], index: np.ndarray) -> list[tuple[Array, int, int]]:
    """Fill ``index`` ``[2, >= rows]`` (row 0: destination rows, row 1: source rows) from
    ``segments`` ``(array, start, count, destination)`` (rows ``start .. start + count`` of
    ``array`` go to rows ``destination ..``), grouped by source array; returns ``(array, lo,
    hi)`` per source array: its pairs are ``index[:, lo:hi]``."""
    by_source: dict[int, tuple] = {}
    for arr, start, count, at in segments:
        _, dst, src = by_source.setdefault(id(arr), (arr, [], []))
        dst.extend(range(at, at + count))
        src.extend(range(start, start + count))
    sources, lo = [], 0
    for arr, dst, src in by_source.values():
        hi = lo + len(dst)
        index[0, lo:hi], index[1, lo:hi] = dst, src
        sources.append((arr, lo, hi))
        lo = hi
    return sources


def segment_destinations(segments: Iterable[tuple[Array, int, int]], at: int = 0):
    """``(array, start, count, destination)`` of each segment stacked from row ``at`` on."""
    for arr, start, count in segments:
        yield arr, start, count, at
        at += count


def gather_into(out: Array, sources: Sequence[tuple[Array, int, int]], index: Array, xp) -> None:
    """``out[index[0, j]] = array[index[1, j]]`` for each ``(array, lo, hi)`` of ``sources`` and
    j in lo..hi-1 (``index`` on ``out``'s device: int64 ``[2, n]``, C-contiguous): one kernel a
    source array on the device (``cuda_kernels.gather_rows``), CuPy's indexing for a source of
    another dtype or layout."""
    if xp is not np:
        from mtpserve.engine.cuda_kernels import gather_rows
    for arr, lo, hi in sources:
        if xp is not np and arr.flags.c_contiguous and arr.dtype == out.dtype:
            gather_rows(out, arr, index, lo, hi)
        else:
            out[index[0, lo:hi]] = arr[index[1, lo:hi]]


def stack_segments(segments: Sequence[tuple[Array, int, int]], xp) -> Array:
    """A new array of the rows of ``segments`` ``(array, start, count)``, in order (what
    ``xp.concatenate`` of the row slices makes, without CuPy's concatenate: it builds a kernel
    with NVRTC on the first use of each arrangement of its arrays, ~0.1 s on a live step)."""
    if not segments:
        raise ValueError("no rows to stack")
    first = segments[0][0]
    total = sum(count for _, _, count in segments)
    out = xp.empty((total, *first.shape[1:]), first.dtype)
    index = np.empty((2, total), np.int64)
    sources = plan_gather(segment_destinations(segments), index)
    gather_into(out, sources, index if xp is np else xp.asarray(index), xp)
    return out
