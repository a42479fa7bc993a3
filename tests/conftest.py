"""Fixtures shared by the whole suite."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The bundled trained model (MTPSERVE_TEST_MODEL overrides it, for trying another export)."""
    from mtpserve.engine.bundled import MODEL_DIR
    path = Path(os.environ.get("MTPSERVE_TEST_MODEL", MODEL_DIR))
    assert (path / "genai_config.json").is_file(), f"no model at {path}: the bundled export is missing"
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of a seeded random Qwen3.5 checkpoint with an MTP head (mtpserve.cluster.bench_model.TINY)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from mtpserve.cluster.bench_model import TINY, make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), TINY)


@pytest.fixture(scope="session")
def tiny_paged_export(tiny_checkpoint, tmp_path_factory):
    """Path of the builder's paged fp16 export (-e cuda, block size 16, capture capacity 4)."""
    pytest.importorskip("onnxruntime_genai")
    from mtpserve.cluster.bench_model import export_paged
    return export_paged(tiny_checkpoint, tmp_path_factory.mktemp("tiny_paged"))
