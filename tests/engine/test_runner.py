"""Packed step inputs: the layout both graphs read (runner module docstring)."""
import numpy as np

from mtpserve.engine.runner import PackedRows, pack_rows


def test_pack_rows_layout_and_block_table_padding():
    rows = [PackedRows([11, 12, 13], past_len=5, block_table=[4]),
            PackedRows([21], past_len=0, block_table=[7, 8])]
    p = pack_rows(rows, scratch_block=0)
    assert p["input_ids"].tolist() == [11, 12, 13, 21]
    assert p["position_ids"].tolist() == [[5, 6, 7, 0]] * 3
    assert p["cumulative_sequence_lengths"].tolist() == [0, 3, 4]
    assert p["past_sequence_lengths"].tolist() == [5, 0]
    assert p["block_table"].tolist() == [[4, 0], [7, 8]]
    assert p["attention_metadata"].tolist() == [3, 8, 1]      # max n, max past + n, min past + n
    wide = pack_rows(rows, scratch_block=0, min_width=6)      # CUDA: the table keeps its full width
    assert wide["block_table"].tolist() == [[4, 0, 0, 0, 0, 0], [7, 8, 0, 0, 0, 0]]
    assert all(np.array_equal(wide[k], p[k]) for k in p if k != "block_table")
