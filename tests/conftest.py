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
