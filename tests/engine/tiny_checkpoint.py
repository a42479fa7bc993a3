"""The tiny random Qwen3.5 checkpoint (GDN + full attention + MTP head) used by end-to-end tests.

The recipe lives in mtpserve.cluster.checkpoints (shared with the benchmark's mid-size model):
every weight is rounded to a float16-representable value, so an fp16 export holds exactly the
checkpoint's weights and an fp32 PyTorch forward is an exact reference for the adapted model.
The session fixtures `tiny_checkpoint` and `tiny_paged_export` are in tests/conftest.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

from mtpserve.cluster.checkpoints import BLOCK_SIZE, CAPTURE_CAPACITY, TINY, export_paged, make_checkpoint  # noqa: F401

VOCAB, HIDDEN, LAYER_TYPES = TINY.vocab_size, TINY.hidden_size, list(TINY.layer_types)


def make_tiny_checkpoint(out: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint to `out` (created) and return it."""
    return make_checkpoint(out, TINY, seed)


if __name__ == "__main__":
    ckpt = make_tiny_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny_ckpt")
    if len(sys.argv) > 2:
        export_paged(ckpt, sys.argv[2])
