"""A served replica whose engine runs in a process of its own (the CUDA default, forced on here):
the same greedy output over HTTP as the engine in process; a dead engine process is a clear 503
for the requests it held, then Serve replaces the replica and it serves again; a replica stopped
gracefully hands its sessions' cached prefixes to the next replica from its engine process."""
from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

ray = pytest.importorskip("ray")
requests = pytest.importorskip("requests")

from test_serving import _module_text, engine_texts  # noqa: E402

from mtpserve.actors.planner import get_planner  # noqa: E402
from mtpserve.cluster.app import ServeOptions  # noqa: E402
from mtpserve.cluster.client import replica_statuses  # noqa: E402
from mtpserve.cluster.deploy import deployed, placement, stop_replica, wait_for_view  # noqa: E402

APP = "engineproc"
PROMPTS = ["def add(a, b):", "import os\nimport"]


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir):
    options = ServeOptions.from_flat(model_dir=str(model_dir), num_replicas=1, num_threads=1, num_blocks=128,
                                     max_resident_requests=4, num_cpus_per_replica=0.5, engine_process=True,
                                     draft_tokens=2)
    with deployed(options, APP, route_prefix=f"/{APP}", timeout_s=60.0):
        yield {"base": f"{ray_cluster['url']}/{APP}", "model": options.served_model_name, "model_dir": model_dir}


def _complete(app, prompt, **params):
    body = {"model": app["model"], "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **params}
    return requests.post(f"{app['base']}/v1/completions", json=body, timeout=60)


def _only_status() -> dict:
    statuses = replica_statuses(APP)
    assert len(statuses) == 1, statuses
    return next(iter(statuses.values()))


def test_greedy_output_over_http_equals_the_engine_in_process(app):
    texts = engine_texts(app["model_dir"], PROMPTS, 24)                 # MTP off, in this process
    for i, p in enumerate(PROMPTS):
        r = _complete(app, p)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == texts[f"r{i}"]
    status = _only_status()
    assert status["integrity"] == "ok" and status["idle_and_empty"]
    assert status["engine_pid"] and status["engine_pid"] != os.getpid()
    assert status["spec"]["num_draft_tokens"] > 0


def test_a_dead_engine_process_is_a_clear_503_then_the_replica_is_replaced(app):
    old = _only_status()
    engine_pid = old["engine_pid"]
    os.kill(engine_pid, signal.SIGKILL)
    r = _complete(app, PROMPTS[0])
    assert r.status_code == 503, r.text
    assert "engine" in r.json()["error"]["message"]
    deadline, served = time.monotonic() + 90, None
    while time.monotonic() < deadline:               # Serve's health check fails, a new replica starts
        served = _complete(app, PROMPTS[1], max_tokens=4)
        if served.status_code == 200:
            break
        time.sleep(1.0)
    assert served is not None and served.status_code == 200, served.text if served else "no answer"
    view = placement(APP)        # the replacement was in the routers' view before it served
    assert view is not None and served.headers["x-mtpserve-replica"] in view.replicas, view
    wait_for_view(APP, lambda v: old["replica_id"] not in v.replicas, 30, "the dead replica leaves the view")
    status = _only_status()
    assert status["engine_pid"] != engine_pid and status["integrity"] == "ok"


def test_a_replica_stopped_gracefully_hands_its_sessions_prefix_over_from_its_engine_process(app):
    """The hand-over end to end where the engine runs in a process of its own (the CUDA default):
    a session's first turn, then its replica stops as Serve stops one it scales down; the
    replacement takes the records before the session's next turn, whose cached_tokens cover the
    first turn's prompt and whose text is the in-process engine's."""
    session = f"ep-{uuid.uuid4().hex[:8]}"
    first = _module_text(f"ep{uuid.uuid4().hex[:6]}") + "result = "
    r = requests.post(f"{app['base']}/v1/completions", headers={"x-session-id": session}, timeout=60,
                      json={"model": app["model"], "prompt": first, "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True})
    assert r.status_code == 200, r.text
    victim, done = r.headers["x-mtpserve-replica"], r.json()
    planner = get_planner(APP)
    before = ray.get(planner.handover_counts.remote())
    stop_replica(APP, victim)
    assert ray.get(planner.handover_counts.remote()).sessions.get("handed_over", 0) > \
        before.sessions.get("handed_over", 0), "the engine process's export handed nothing over"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:                 # Serve's replacement reports to the planner
        view = placement(APP)
        if view is not None and view.replicas and victim not in view.replicas:
            break
        time.sleep(0.5)
    turn2 = first + done["choices"][0]["text"] + "\n# next\nvalue = "
    moved = requests.post(f"{app['base']}/v1/completions", headers={"x-session-id": session}, timeout=60,
                          json={"model": app["model"], "prompt": turn2, "max_tokens": 8, "temperature": 0,
                                "ignore_eos": True})
    assert moved.status_code == 200, moved.text
    assert moved.headers["x-mtpserve-replica"] != victim
    n = done["usage"]["prompt_tokens"]
    assert moved.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0
    assert moved.json()["choices"][0]["text"] == engine_texts(app["model_dir"], [turn2], 8)["r0"]
    status = _only_status()
    assert status["integrity"] == "ok" and status["idle_and_empty"], status
