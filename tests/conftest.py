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
    """Path of a seeded random Qwen3.5 checkpoint with an MTP head (mtpserve.cluster.checkpoints.TINY)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from mtpserve.cluster.checkpoints import TINY, make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), TINY)


@pytest.fixture(scope="session")
def tiny_paged_export(tiny_checkpoint, tmp_path_factory):
    """Path of the builder's paged fp16 export (-e cuda, block size 16, capture capacity 4)."""
    pytest.importorskip("onnxruntime_genai")
    from mtpserve.cluster.checkpoints import export_paged
    return export_paged(tiny_checkpoint, tmp_path_factory.mktemp("tiny_paged"))


# ---- serving: one local Ray cluster per test session, sized for a 2-core machine, with Serve's
# HTTP proxy on a free port; apps are deployed per module by the tests.
PORT_ENV = "MTPSERVE_TEST_HTTP_PORT"


@pytest.fixture(scope="session")
def ray_cluster():
    """{"address": GCS address, "url": Serve's HTTP base URL}; reuses a Ray started earlier."""
    ray = pytest.importorskip("ray")
    from mtpserve.cluster import deploy
    from mtpserve.cluster.local_cluster import free_port
    started = not ray.is_initialized()
    port = int(os.environ.setdefault(PORT_ENV, str(free_port())))
    if started:
        # the proxy answers requests whose replica died with OpenAI errors (the middleware)
        deploy.connect(num_cpus=4, quiet=True)
        deploy.start_http("127.0.0.1", port)
    yield {"address": ray.get_runtime_context().gcs_address, "url": f"http://127.0.0.1:{port}"}
    if started:
        deploy.teardown(None)
