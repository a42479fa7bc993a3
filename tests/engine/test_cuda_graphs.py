"""Which step a captured CUDA graph runs, and with which padding (the choice is host logic: it
runs here; the replays themselves are in test_cuda.py, on the device)."""
from __future__ import annotations

from mtpserve.engine.cuda_graphs import GraphCatalog, GraphShape, graph_batch_sizes, table_width_buckets


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


def test_shapes_are_captured_largest_first_every_one_once():
    """ORT's arena grows in regions it never merges: the shape whose attention buffers are the
    largest (batch x KV bucket, then rows per request) is captured first, so the others can be
    cut from its free chunks; every shape is still captured, once."""
    order = CATALOG.capture_order()
    assert sorted(order, key=str) == sorted(CATALOG.shapes(), key=str) and len(set(order)) == len(order)
    assert order[0] == GraphShape(8, 3, 63, 1) and order[-1] == GraphShape(1, 1, 16, 0)
    footprints = [s.batch * s.table_width for s in order]
    assert footprints == sorted(footprints, reverse=True)
