"""The Ray fixture shared by the serving tests (tests/actors and tests/cluster import it).

One local Ray cluster per test session, sized for a 2-core machine, with Serve's HTTP proxy on a
free port; apps are deployed per module by the tests (``model_dir`` comes from tests/conftest.py).
"""
from __future__ import annotations

import os
import socket

import pytest

PORT_ENV = "MTPSERVE_TEST_HTTP_PORT"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """{"address": GCS address, "url": Serve's HTTP base URL}; reuses a Ray started earlier."""
    ray = pytest.importorskip("ray")
    from ray import serve
    started = not ray.is_initialized()
    port = int(os.environ.setdefault(PORT_ENV, str(_free_port())))
    if started:
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield {"address": ray.get_runtime_context().gcs_address, "url": f"http://127.0.0.1:{port}"}
    if started:
        serve.shutdown()
        ray.shutdown()
