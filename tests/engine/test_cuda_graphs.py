"""Which step a captured CUDA graph runs, and with which padding (the choice is host logic: it
runs here; the replays themselves are in test_cuda.py, on the device)."""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from mtpserve.engine import cuda_graphs
from mtpserve.engine.cuda_graphs import (
    CaptureOutOfMemory,
    GraphCatalog,
    GraphShape,
    graph_batch_sizes,
    is_out_of_memory,
    table_width_buckets,
)


def test_batch_sizes_cover_every_batch_up_to_the_limit():
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(6) == (1, 2, 4, 6)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(50)[-2:] == (48, 50)


def test_kv_buckets_are_powers_of_two_up_to_the_whole_context():
    assert table_width_buckets(16, 4096) == (16, 32, 64, 128, 256)
    assert table_width_buckets(16, 1000) == (16, 32, 63)          # the last bucket is the context itself
    assert table_width_buckets(16, 200) == (13,)


CATALOG = GraphCatalog(batch_sizes=(1, 2, 4, 8), token_counts=(1, 3), table_widths=(16, 32, 63), block_size=16)


def test_a_decode_step_takes_the_smallest_batch_and_the_tightest_bucket():
    assert CATALOG.choose([1, 1, 1], [1, 1, 1], [10, 300, 256]) == (4, 1, 32)
    assert CATALOG.choose([1], [1], [256]) == (1, 1, 16)
    assert CATALOG.choose([3] * 8, [1] * 8, [1000] * 8) == (8, 3, 63)       # verify of K=2 drafts


def test_steps_without_a_graph_run_eagerly():
    assert CATALOG.choose([1] * 9, [1] * 9, [10] * 9) is None                # more requests than any graph
    assert CATALOG.choose([1], [1], [1009]) is None                          # KV longer than the context bucket
    assert CATALOG.choose([3, 1], [1, 1], [10, 10]) is None                  # draft counts differ
    assert CATALOG.choose([2, 2], [1, 1], [10, 10]) is None                  # K=1 was not captured
    assert CATALOG.choose([3, 1], [3, 1], [10, 10]) is None                  # a prompt chunk of 3 tokens
    assert CATALOG.choose([], [], []) is None


def test_every_shape_is_captured_for_both_banks():
    shapes = CATALOG.shapes()
    assert len(shapes) == len(set(shapes)) == 4 * 2 * 3 * 2
    assert GraphShape(8, 3, 63, 1) in shapes and GraphShape(8, 3, 63, 0) in shapes


HEAD = GraphCatalog(batch_sizes=(1, 2, 4, 8), token_counts=(1, 3, 16, 64), table_widths=(16, 63), block_size=16,
                    banks=(0,), max_rows=64)


def test_head_fill_shapes_stay_within_the_row_limit():
    """The head's fill shapes (16 and 64 rows a request) are captured only where batch x rows
    fits ``max_rows``: no [rows, vocab] logits buffer sized for 8 x 64 rows."""
    shapes = {(s.batch, s.tokens) for s in HEAD.shapes()}
    assert shapes == {(b, n) for b in (1, 2, 4, 8) for n in (1, 3)} | {(1, 16), (2, 16), (4, 16), (1, 64)}


def test_head_fill_groups_pad_like_pieces_together_and_leave_the_too_long_out():
    fills = (16, 64)
    assert HEAD.fill_groups([40, 9, 5, 3], fills) == [([0], 1, 64), ([1, 2, 3], 4, 16)]
    assert HEAD.fill_groups([12] * 6, fills) == [([0, 1, 2, 3], 4, 16), ([4, 5], 2, 16)]
    assert HEAD.fill_groups([65, 2], fills) == [([1], 1, 16)]           # 65 rows: no count holds them
    assert HEAD.fill_groups([], fills) == []
    for lengths in ([1, 64, 17, 16, 3, 30, 30], [7] * 9):
        groups = HEAD.fill_groups(lengths, fills)
        assert sorted(i for g, _, _ in groups for i in g) == list(range(len(lengths)))   # each piece once
        for group, batch, n in groups:
            assert batch == HEAD.batch_for(len(group)) and batch * n <= 64 and n in fills
            assert all(lengths[i] <= n for i in group)


def test_shapes_are_captured_largest_first_every_one_once():
    """ORT's arena grows in regions it never merges: the shape whose attention buffers are the
    largest (batch x KV bucket, then rows per request) is captured first, so the others can be
    cut from its free chunks; every shape is still captured, once."""
    order = CATALOG.capture_order()
    assert sorted(order, key=str) == sorted(CATALOG.shapes(), key=str) and len(set(order)) == len(order)
    assert order[0] == GraphShape(8, 3, 63, 1) and order[-1] == GraphShape(1, 1, 16, 0)
    footprints = [s.batch * s.table_width for s in order]
    assert footprints == sorted(footprints, reverse=True)


# ---- a capture that runs out of device memory says where, and what to change ------------------
ORT_OOM = ("Error in execution: Non-zero status code returned while running PagedAttention node. Name:'/model/"
           "layers.0/attn/PagedAttention' Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:"
           "360 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) Failed to "
           "allocate memory for requested buffer of size 2684354560")     # session 18's, on the H200


def test_out_of_memory_is_told_from_other_errors():
    assert is_out_of_memory(RuntimeError(ORT_OOM))
    assert is_out_of_memory(type("OutOfMemoryError", (Exception,), {})("Out of memory allocating 1,024 bytes"))
    assert not is_out_of_memory(RuntimeError("Non-zero status code returned while running MatMul node"))
    assert not is_out_of_memory(ValueError("bad shape"))


@pytest.fixture
def fake_cupy(monkeypatch):
    """The two CuPy calls the capture loop makes (a stream to sync, the device's free / total
    bytes), on the CPU: free memory falls 3 GiB with each capture."""
    gib, state = 2 ** 30, {"free": 40 * 2 ** 30}
    runtime = types.SimpleNamespace(memGetInfo=lambda: (state["free"], 80 * gib))
    stream = types.SimpleNamespace(synchronize=lambda: None)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, get_current_stream=lambda: stream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return state


def test_a_capture_out_of_memory_names_its_graph_and_the_settings_that_shrink_it(fake_cupy):
    captured = []

    def capture(shape):
        if len(captured) == 2:
            raise RuntimeError(ORT_OOM)
        captured.append(shape)
        fake_cupy["free"] -= 3 * 2 ** 30

    with pytest.raises(CaptureOutOfMemory) as e:
        cuda_graphs._capture_shapes("main model", CATALOG, {}, capture, lambda _: None, advice="Try --cuda-graphs off.")
    shape = CATALOG.capture_order()[2]
    msg = str(e.value)
    assert f"{shape.batch} requests x {shape.tokens} rows, KV bucket {shape.table_width * 16} tokens" in msg
    assert f"3 of {len(CATALOG.capture_order())}" in msg and "taken 6.0 GiB" in msg and "34.0 GiB of 80.0 GiB" in msg
    assert msg.endswith("Try --cuda-graphs off.")
    assert isinstance(e.value.__cause__, RuntimeError)            # ORT's own error stays chained


def test_each_capture_s_memory_is_counted_against_its_shape(fake_cupy):
    """What a catalog costs is the sum of its shapes' captures (ORT keeps each graph's buffers):
    each shape gets the free memory its own capture took, and the set's total is their sum."""
    order = CATALOG.capture_order()

    def capture(shape):
        fake_cupy["free"] -= (order.index(shape) + 1) * 2 ** 20     # the i-th capture takes i MiB

    by_shape = {}
    seconds, nbytes = cuda_graphs._capture_shapes("main model", CATALOG, {}, capture, lambda _: None,
                                                  by_shape=by_shape)
    assert list(by_shape) == order
    assert [by_shape[s] // 2 ** 20 for s in order] == list(range(1, len(order) + 1))
    assert nbytes == sum(by_shape.values())


def test_other_capture_errors_pass_through_unchanged(fake_cupy):
    def capture(shape):
        raise RuntimeError("Non-zero status code returned while running MatMul node")

    with pytest.raises(RuntimeError, match="MatMul") as e:
        cuda_graphs._capture_shapes("main model", CATALOG, {}, capture, lambda _: None)
    assert not isinstance(e.value, CaptureOutOfMemory)


def test_the_engines_advice_names_the_settings_it_can_change(model_dir):
    """The bundled model: head size 64, so flash takes 256-token blocks; its export's 16 can be
    served at 256 (the builder's graphs leave the block size to the pools' shape)."""
    from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from mtpserve.engine.engine import Engine

    def advice(k, block_size=None):
        return Engine(EngineConfig(str(model_dir), num_threads=1, spec=SpecConfig(k),
                                   scheduler=SchedulerConfig(max_requests_per_step=32),
                                   cache=CacheConfig(kv_block_size=block_size))).capture_memory_advice()

    mtp = advice(2)
    assert "--kv-block-size 256" in mtp and "--max-requests-per-step below 32" in mtp
    assert "--draft-tokens 0" in mtp and "--cuda-graphs off" in mtp and "--max-model-len below 2048" in mtp
    assert "--draft-tokens" not in advice(0)                     # no verify or head graphs to drop
    assert "--kv-block-size" not in advice(2, block_size=256)    # already one flash takes


def test_a_uniform_steps_staging_holds_its_rows_then_padding_on_the_scratch_block():
    """A captured step's host staging (``_fill_step``): request b's ids, its past length, the
    positions past + 0..n-1 of its n rows (all three rows of position ids) and its first
    ``width`` blocks; padding requests after the real ones at position 0 on block 0."""
    import numpy as np

    from mtpserve.engine.runner import PackedRows
    batch, n, width = 4, 3, 4
    host = {"input_ids": np.full(batch * n, -1, np.int64), "position_ids": np.full((3, batch * n), -1, np.int64),
            "past_sequence_lengths": np.full(batch, -1, np.int32), "block_table": np.full((batch, width), -1, np.int32)}
    rows = [PackedRows([5, 6, 7], 10, np.array([1, 2], np.int32)),
            PackedRows([8, 9, 10], 33, np.array([3, 4, 5, 6, 7], np.int32))]
    cuda_graphs._fill_step(host, rows, n, width)
    assert host["input_ids"].tolist() == [5, 6, 7, 8, 9, 10] + [0] * 6
    assert host["past_sequence_lengths"].tolist() == [10, 33, 0, 0]
    assert host["position_ids"].tolist() == [[10, 11, 12, 33, 34, 35, 0, 1, 2, 0, 1, 2]] * 3
    assert host["block_table"].tolist() == [[1, 2, 0, 0], [3, 4, 5, 6], [0, 0, 0, 0], [0, 0, 0, 0]]
    for n in (1, 300):         # a decode step's one row a request; a fill longer than the offsets kept
        host["past_sequence_lengths"][:] = [7, 20, 0, 0]
        host["position_ids"] = np.full((3, batch * n), -1, np.int64)
        cuda_graphs._fill_positions(host, n)
        want = np.concatenate([past + np.arange(n) for past in (7, 20, 0, 0)])
        assert (host["position_ids"] == want).all()


def test_the_heads_padded_staging_puts_each_requests_rows_first_in_its_slots():
    """``_fill_padded`` (the head's catch-up and fills): request b's rows first in its n slots,
    token 0 after them and for the padding requests; positions and blocks as ``_fill_step``'s."""
    import numpy as np

    from mtpserve.engine.runner import PackedRows
    batch, n, width = 3, 3, 2
    host = {"input_ids": np.full(batch * n, -1, np.int64), "position_ids": np.full((3, batch * n), -1, np.int64),
            "past_sequence_lengths": np.full(batch, -1, np.int32), "block_table": np.full((batch, width), -1, np.int32)}
    rows = [PackedRows([5], 10, np.array([1], np.int32)), PackedRows([8, 9, 10], 33, np.array([3, 4, 5], np.int32))]
    cuda_graphs._fill_padded(host, rows, n, width)
    assert host["input_ids"].tolist() == [5, 0, 0, 8, 9, 10, 0, 0, 0]
    assert host["past_sequence_lengths"].tolist() == [10, 33, 0]
    assert host["position_ids"].tolist() == [[10, 11, 12, 33, 34, 35, 0, 1, 2]] * 3
    assert host["block_table"].tolist() == [[1, 0], [3, 4], [0, 0]]


def test_staged_block_tables_are_rewritten_when_a_requests_table_or_the_width_changes():
    """``_fill_rows`` with the staging's ``_StagedTables``: rows carrying the very table objects
    the staging holds leave it as it is; a request's new table (a new block: the pool makes a new
    array), other requests, or another width rewrite it, padding rows back on block 0."""
    import numpy as np

    from mtpserve.engine.runner import PackedRows
    batch, width = 3, 3
    host = {"input_ids": np.zeros(batch, np.int64), "position_ids": np.zeros((3, batch), np.int64),
            "past_sequence_lengths": np.zeros(batch, np.int32), "block_table": np.full((batch, width), -1, np.int32)}
    staged = cuda_graphs._StagedTables()
    a, b = np.array([1, 2], np.int32), np.array([3], np.int32)
    cuda_graphs._fill_rows(host, [PackedRows((), 20, a), PackedRows((), 5, b)], 1, width, staged)
    assert host["block_table"].tolist() == [[1, 2, 0], [3, 0, 0], [0, 0, 0]]
    host["block_table"][2, 0] = 99                     # (stands for what the staging holds: untouched)
    cuda_graphs._fill_rows(host, [PackedRows((), 21, a), PackedRows((), 6, b)], 1, width, staged)
    assert host["block_table"][2, 0] == 99 and host["past_sequence_lengths"].tolist() == [21, 6, 0]
    b2 = np.array([3, 7], np.int32)                     # request 1 took a block
    cuda_graphs._fill_rows(host, [PackedRows((), 22, a), PackedRows((), 16, b2)], 1, width, staged)
    assert host["block_table"].tolist() == [[1, 2, 0], [3, 7, 0], [0, 0, 0]]
    cuda_graphs._fill_rows(host, [PackedRows((), 22, b2)], 1, width, staged)        # other requests
    assert host["block_table"].tolist() == [[3, 7, 0], [0, 0, 0], [0, 0, 0]]
    cuda_graphs._fill_rows(host, [PackedRows((), 22, b2)], 1, 1, staged)            # another width
    assert host["block_table"].tolist() == [[3, 0, 0], [0, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("batch,k1,R", [(4, 3, 3), (8, 2, 4), (1, 1, 3)])
def test_a_draft_continuations_head_staging_in_arrays_is_the_row_objects_staging(batch, k1, R):
    """``HeadGraphs.draft_after``'s staging (``_stage_catch_up_after``, ``_stage_rows``:
    array operations, no row object a request) writes what ``draft`` stages from row objects for
    the same continuation: placeholders for ids, past lengths, positions, tables, each request's
    last real row and chained start, and the gather of its K1 hidden rows from the step's one
    hidden array; padding requests after the real ones."""
    import numpy as np

    from mtpserve.engine.runner import PackedRows
    rng = np.random.default_rng(batch * 10 + k1)
    B, width = max(1, batch - 1), 4

    def host(n):
        return {"input_ids": np.full(batch * n, -1, np.int64), "position_ids": np.full((3, batch * n), -1, np.int64),
                "past_sequence_lengths": np.full(batch, -1, np.int32),
                "block_table": np.full((batch, width), -1, np.int32), "last_rows": np.full(batch, -1, np.int64),
                "gather": np.full((2, batch * n), -1, np.int64), "chain": np.full((2, batch), -1, np.int64)}

    past = rng.integers(0, 50, B).astype(np.int64)
    tables = tuple(np.array(rng.integers(1, 99, int(rng.integers(1, 6))), np.int32) for _ in range(B))
    starts = [b * k1 for b in range(B)]
    hidden = np.zeros((B * k1, 2))
    rows = [PackedRows([0] * k1, int(p), t) for p, t in zip(past, tables)]
    want, got = host(R), host(R)
    sources = cuda_graphs._stage_catch_up(want, rows, [[(hidden, s, k1)] for s in starts], R, width, None)
    cuda_graphs._stage_catch_up_after(got, past, tables, starts, k1, R, width, None)
    assert sources == [(hidden, 0, B * k1)]
    again = host(R)                                                    # (the shape's rows, made once, reused)
    cuda_graphs._stage_catch_up_after(again, past, tables, starts, k1, R, width, None)
    want["gather"][:, B * k1:] = got["gather"][:, B * k1:] = again["gather"][:, B * k1:] = 0   # (not read)
    for name in want:
        assert (want[name] == got[name]).all() and (want[name] == again[name]).all(), name
    want, got = host(1), host(1)
    cuda_graphs._fill_rows(want, [PackedRows((), int(p) + k1, t) for p, t in zip(past, tables)], 1, width)
    cuda_graphs._stage_rows(got, past + k1, tables, 1, width, None)
    for name in ("past_sequence_lengths", "position_ids", "block_table"):
        assert (want[name] == got[name]).all(), name


def test_a_continuations_verify_staging_in_arrays_is_the_row_objects_staging():
    """``StepGraphs.run_after``'s staging (``_stage_uniform``: past lengths and tables as arrays,
    ids left to the device) writes what ``run`` stages from row objects with placeholder ids."""
    import numpy as np

    from mtpserve.engine.runner import PackedRows
    batch, n, width = 4, 3, 3
    rng = np.random.default_rng(7)

    def host():
        return {"input_ids": np.full(batch * n, -1, np.int64), "position_ids": np.full((3, batch * n), -1, np.int64),
                "past_sequence_lengths": np.full(batch, -1, np.int32),
                "block_table": np.full((batch, width), -1, np.int32)}

    past = np.array([4, 40, 17], np.int64)
    tables = tuple(np.array(rng.integers(1, 99, k), np.int32) for k in (1, 5, 2))
    want, got = host(), host()
    cuda_graphs._fill_step(want, [PackedRows([0] * n, int(p), t) for p, t in zip(past, tables)], n, width)
    cuda_graphs._stage_uniform(got, past, tables, n, width)
    for name in want:
        assert (want[name] == got[name]).all(), name


# ---------------------------------------------------------------------- captured prompt steps
PROMPTS = cuda_graphs.PromptCatalog(batch_sizes=(2, 4, 8, 17), row_buckets=(64, 128, 256), table_widths=(16, 32, 63),
                                    block_size=16)


def test_prompt_batches_keep_a_slot_for_the_padding_request():
    assert cuda_graphs.prompt_batch_sizes(16) == (2, 4, 8, 16, 17)
    assert cuda_graphs.prompt_batch_sizes(64) == (2, 4, 8, 16, 32, 64, 65)
    assert cuda_graphs.prompt_batch_sizes(1) == (2,)
    assert cuda_graphs.prompt_row_buckets(2048) == (64, 128, 256, 512, 1024, 2048)
    assert cuda_graphs.prompt_row_buckets(300) == (64, 128, 256, 300)


def test_a_prompt_step_takes_the_fewest_rows_a_spare_slot_and_a_bucket_its_padding_fits():
    assert PROMPTS.choose([40, 1, 1], [40, 300, 120]) == (4, 64, 32)         # 42 rows: 22 padding in one slot
    assert PROMPTS.choose([64], [64]) == (2, 64, 16)                          # every row real: an empty padding slot
    assert PROMPTS.choose([1] * 16, [500] * 16) == (17, 64, 32)               # all 16 slots: the scratch row pads
    assert PROMPTS.choose([10, 10], [10, 10]) == (4, 64, 16)
    # 129 rows in 256: 127 padding rows over one slot fit a 256-token bucket (the padding sits at
    # positions 0..126 on the scratch block; it must stay inside the table)
    assert PROMPTS.choose([129], [129]) == (2, 256, 16)
    assert PROMPTS.choose([100, 29], [100, 29]) == (4, 256, 16)
    assert PROMPTS.choose([257], [257]) is None                              # more rows than any bucket
    assert PROMPTS.choose([1] * 17, [10] * 17) is None                       # no slot to spare
    assert PROMPTS.choose([5], [1009]) is None                               # KV past the context
    assert PROMPTS.choose([], []) is None
    # no fewer rows than slots (ORT's varlen kernels refuse them): 64 decode rows take 65 slots,
    # so 128 rows, not the 64-row bucket
    wide = cuda_graphs.PromptCatalog((2, 4, 8, 16, 32, 64, 65), (64, 128), (16,), 16)
    assert wide.choose([1] * 64, [10] * 64) == (65, 128, 16)
    assert wide.choose([2] * 31, [10] * 31) == (32, 64, 16)


def test_narrow_tables_push_the_padding_to_a_wider_bucket():
    narrow = cuda_graphs.PromptCatalog((2, 4), (1024,), (16, 64), 16)
    # 24 real rows leave 1000 padding rows: over one slot they need 63 blocks, a 64-block table
    assert narrow.choose([24], [24]) == (2, 1024, 64)
    assert narrow.choose([8, 8, 8], [8, 8, 8]) == (4, 1024, 64)              # one slot, 1000 rows: still wide
    assert cuda_graphs.PromptCatalog((2, 4), (1024,), (16,), 16).choose([24], [24]) is None


def test_prompt_shapes_are_every_batch_rows_bucket_and_bank_whose_slots_hold_the_rows():
    shapes = PROMPTS.shapes()
    # batch 2 at 16 blocks (256 tokens a slot) holds 256 rows at most: every combination does here
    assert len(shapes) == len(set(shapes)) == 4 * 3 * 3 * 2
    narrow = cuda_graphs.PromptCatalog((2, 4), (64, 1024), (4, 64), 16)
    assert cuda_graphs.GraphShape(2, 1024, 4, 0) not in narrow.shapes()          # 2 slots x 64 tokens < 1024
    assert cuda_graphs.GraphShape(2, 64, 4, 0) in narrow.shapes() and len(narrow.shapes()) == (4 + 2) * 2
    wide = cuda_graphs.PromptCatalog((2, 64, 65), (64, 128), (16,), 16).shapes()
    assert cuda_graphs.GraphShape(65, 64, 16, 0) not in wide and cuda_graphs.GraphShape(64, 64, 16, 0) in wide
    assert all(s.batch <= s.tokens for s in wide) and len(wide) == (3 + 2) * 2
    order = PROMPTS.capture_order()
    assert order[0].tokens == 256 and order[-1].tokens == 64 and sorted(order, key=repr) == sorted(shapes, key=repr)
    assert "17 requests, 256 rows in all, KV bucket 1008 tokens" == PROMPTS.describe(cuda_graphs.GraphShape(17, 256, 63, 0))


def test_prompt_shapes_past_the_slot_token_bound_are_neither_captured_nor_chosen():
    """``max_slot_tokens`` bounds slots x KV-bucket tokens (what ORT's varlen attention holds, so
    the memory the captures take): no shape past it, and a step whose smallest fitting shape is
    past it gets none (it runs eagerly) rather than a shape that was never captured."""
    bounded = dataclasses.replace(PROMPTS, max_slot_tokens=8 * 32 * 16)          # 8 slots at 512 tokens
    shapes = bounded.shapes()
    assert shapes and all(s.batch * s.table_width * 16 <= 8 * 32 * 16 for s in shapes)
    assert cuda_graphs.GraphShape(8, 64, 32, 0) in shapes and cuda_graphs.GraphShape(17, 64, 16, 0) not in shapes
    assert cuda_graphs.GraphShape(8, 64, 63, 0) not in shapes                   # 8 x 1008 tokens
    assert bounded.choose([40, 1, 1], [40, 300, 120]) == (4, 64, 32)           # 4 x 512: within
    assert bounded.choose([1] * 16, [500] * 16) is None                         # 17 x 512: past it
    assert bounded.choose([5] * 5, [900] * 5) is None                           # 8 x 1008: past it
    assert PROMPTS.choose([5] * 5, [900] * 5) == (8, 64, 63)                    # (unbounded: chosen)
    assert bounded.choose([5, 1], [5, 900]) == (4, 64, 63)                      # 4 x 1008: within
    for lengths, kv in (([40, 1, 1], [40, 300, 120]), ([1] * 7, [200] * 7), ([100, 29], [100, 29])):
        choice = bounded.choose(lengths, kv)
        assert choice is None or cuda_graphs.GraphShape(*choice, 0) in shapes
    assert "slots x KV bucket <= 4096 tokens" in bounded.summary()


def _varlen_host(batch: int, total: int, width: int):
    import numpy as np
    return {"input_ids": np.full(total, -1, np.int64), "position_ids": np.full((3, total), -1, np.int64),
            "cumulative_sequence_lengths": np.full(batch + 1, -1, np.int32),
            "past_sequence_lengths": np.full(batch, -1, np.int32), "block_table": np.full((batch, width), -1, np.int32)}


def test_a_prompt_steps_staging_puts_its_rows_first_and_spreads_the_padding():
    import numpy as np

    from mtpserve.engine.runner import PackedRows
    host = _varlen_host(5, 16, 4)
    rows = [PackedRows([5, 6, 7], 0, np.array([1], np.int32)), PackedRows([8], 30, np.array([2, 3], np.int32))]
    cuda_graphs._stage_varlen(host, rows, batch=5, total=16, width=4)
    assert host["input_ids"].tolist() == [5, 6, 7, 8] + [0] * 12
    assert host["cumulative_sequence_lengths"].tolist() == [0, 3, 4, 8, 12, 16]     # 12 padding rows, 4 a slot
    assert host["past_sequence_lengths"].tolist() == [0, 30, 0, 0, 0]
    assert host["position_ids"].tolist() == [[0, 1, 2, 30, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]] * 3
    assert host["block_table"].tolist() == [[1, 0, 0, 0], [2, 3, 0, 0]] + [[0] * 4] * 3
    host = _varlen_host(5, 5, 4)
    cuda_graphs._stage_varlen(host, rows, batch=5, total=5, width=4)      # one padding row: the other slots empty
    assert host["cumulative_sequence_lengths"].tolist() == [0, 3, 4, 5, 5, 5]
    with pytest.raises(AssertionError, match="do not fit"):
        cuda_graphs._stage_varlen(host, rows, batch=2, total=16, width=4)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_prompt_steps_staging_computes_what_the_eager_forward_does(model_dir, monkeypatch, mixed):
    """The varlen staging run through the model (ORT's CPU kernels, as the staging would feed a
    captured prompt step on CUDA): the real rows' logits and the real requests' present states
    equal the eager forward's over the rows alone. ``mixed``: after the prompts, a step of a
    3-row chunk and decode rows at their past lengths, from the prompts' states and KV."""
    import numpy as np

    from mtpserve.engine import runner as runner_mod
    from mtpserve.engine.config import EngineConfig
    from mtpserve.engine.engine import Engine
    from mtpserve.engine.runner import PackedRows
    from mtpserve.engine.state_bank import StepStates
    engine = Engine(EngineConfig(str(model_dir), num_threads=1, max_model_len=512))
    r, spec, bs = engine.runner, engine.state_bank.spec, engine.manifest.block_size
    lengths, batch, total, width = [40, 7, 1, 3, 20], 8, 128, 8
    tables = [list(range(1 + b * width, 1 + (b + 1) * width)) for b in range(len(lengths))]
    rng = np.random.default_rng(0)
    rows = [PackedRows(rng.integers(3, 4000, k).tolist(), 0, t) for k, t in zip(lengths, tables)]
    past = spec.zero_states(len(rows), np)
    if mixed:
        past = r.run_main(rows, past, np.zeros(len(rows), np.int32)).present
        rows = [PackedRows(rng.integers(3, 4000, 3 if b == 0 else 1).tolist(), k, t)
                for b, (k, t) in enumerate(zip(lengths, tables))]
    reference = r.run_main(rows, past, np.zeros(len(rows), np.int32))
    reference = (reference.logits.copy(), reference.present.conv.copy(), reference.present.recurrent.copy())
    host = _varlen_host(batch, total, width)
    cuda_graphs._stage_varlen(host, rows, batch, total, width)
    staged = {**host, "attention_metadata": np.array([total, width * bs, 1], np.int32)}   # a graph's loose bounds
    monkeypatch.setattr(runner_mod, "pack_rows", lambda *a, **k: {name: a.copy() for name, a in staged.items()})
    padded = StepStates(spec.layer_ids, np.zeros((len(spec.layer_ids), batch, *past.conv.shape[2:]), past.conv.dtype),
                        np.zeros((len(spec.layer_ids), batch, *past.recurrent.shape[2:]), past.recurrent.dtype))
    padded.conv[:, :len(rows)], padded.recurrent[:, :len(rows)] = past.conv, past.recurrent
    out = r.run_main([None] * batch, padded, np.zeros(batch, np.int32))
    n = sum(len(x.token_ids) for x in rows)
    assert (out.logits[:n] == reference[0]).all()
    assert (out.present.conv[:, :len(rows)] == reference[1]).all()
    assert (out.present.recurrent[:, :len(rows)] == reference[2]).all()
