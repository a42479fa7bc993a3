"""row_gather: the head's catch-up rows from several steps' hidden outputs, a gather a source
array. The plan and the numpy path run here; test_cuda runs the device's."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpserve.engine.row_gather import plan_gather, stack_segments


def test_a_batch_caught_up_after_a_pause_takes_one_gather_a_step_output():
    """Three requests, each with one pending row from each of four steps' outputs: four gathers
    (one a source array), not twelve copies, and the rows in the requests' order."""
    rng = np.random.default_rng(0)
    steps = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(4)]
    segments = [(step, b, 1, 4 * b + i) for b in range(3) for i, step in enumerate(steps)]
    index = np.empty((2, 12), np.int64)
    sources = plan_gather(segments, index)
    assert [id(a) for a, _, _ in sources] == [id(s) for s in steps]
    for arr, lo, hi in sources:
        assert index[0, lo:hi].tolist() == [i + 4 * b for b in range(3) for i in range(4) if steps[i] is arr]
        assert index[1, lo:hi].tolist() == [0, 1, 2]
    got = stack_segments([(a, s, n) for a, s, n, _ in segments], np)
    np.testing.assert_array_equal(got, np.stack([steps[i][b] for b in range(3) for i in range(4)]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.integers(0, 4)), min_size=1, max_size=12))
def test_stacked_segments_equal_the_concatenated_slices(picks):
    arrays = [np.arange(40, dtype=np.float32).reshape(10, 4) + 100 * k for k in range(4)]
    segments = [(arrays[k], start, min(count, 10 - start)) for k, start, count in picks]
    got = stack_segments(segments, np)
    want = np.concatenate([a[s:s + n] for a, s, n in segments])
    np.testing.assert_array_equal(got, want)
    for a in arrays:
        a[:] = -1                                   # a copy: later writes to a step's output do not reach it
    np.testing.assert_array_equal(got, want)


def test_no_segments_is_an_error():
    with pytest.raises(ValueError):
        stack_segments([], np)
