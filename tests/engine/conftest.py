"""Session fixtures: the tiny random Qwen3.5 checkpoint and its paged fp16 export, built once."""
from __future__ import annotations

import pytest

from tiny_checkpoint import export_paged, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of a seeded random Qwen3.5 checkpoint with an MTP head (see tiny_checkpoint.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))


@pytest.fixture(scope="session")
def tiny_paged_export(tiny_checkpoint, tmp_path_factory):
    """Path of the builder's paged fp16 export (-e cuda, block size 16, capture capacity 4)."""
    pytest.importorskip("onnxruntime_genai")
    return export_paged(tiny_checkpoint, tmp_path_factory.mktemp("tiny_paged"))
