"""`serve --direct-port P --api-servers 2`: the replica's own HTTP processes serve its direct URL
with the replica's answers, errors and metrics; a client that leaves frees its request, and
stopping serve stops them."""
from __future__ import annotations

import os
import queue
import re
import sys
import time
from pathlib import Path

import pytest

requests = pytest.importorskip("requests")
openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).parent))
from serve_process import start_serve  # noqa: E402

from mtpserve.cluster.client import replica_statuses  # noqa: E402
from mtpserve.cluster.local_cluster import free_port  # noqa: E402

APP, KEY = "api-servers", "api-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(ray_cluster, model_dir):
    port = free_port()
    serve = start_serve(ray_cluster, model_dir, APP, "--direct-port", str(port), "--api-servers", "2",
                        "--engine-process", "on", "--num-threads", "1", "--api-key", KEY, "--shutdown-grace-s", "1")
    lines, deadline = [], time.monotonic() + 60
    while not any("direct (replica" in line for line in lines):
        assert serve.proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        try:
            lines.append(serve.lines.get(timeout=1))
        except queue.Empty:
            pass
    (line,) = [line for line in lines if "direct (replica" in line]
    assert "2 API servers" in line, line
    yield {"proxy": f"{ray_cluster['url']}/v1", "direct": line.split(": ", 1)[1].strip(), "model": serve.model,
           "serve": serve, "port": port}
    serve.stop()


def _success_count(metrics_text: str, name: str = "mtpserve:request_success_total") -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        rf'^{name}\{{[^}}]*replica="[^"]*"[^}}]*\}} (\S+)$', metrics_text, re.M))


def _wait(predicate, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, what
            return value
        time.sleep(0.2)


def test_api_servers_answer_as_the_replica_does(served):
    body = {"model": served["model"], "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    via_proxy = requests.post(f"{served['proxy']}/completions", json=body, headers=AUTH, timeout=60)
    via_direct = requests.post(f"{served['direct']}/completions", json=body, headers=AUTH, timeout=60)
    assert via_proxy.status_code == via_direct.status_code == 200, via_direct.text
    assert via_direct.json()["choices"][0]["text"] == via_proxy.json()["choices"][0]["text"]
    assert via_direct.headers["x-mtpserve-replica"] == via_proxy.headers["x-mtpserve-replica"]
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    texts = []
    for base in (served["proxy"], served["direct"]):
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60)
        chunks = client.chat.completions.create(model=served["model"], messages=messages, max_tokens=12,
                                                temperature=0, stream=True)
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert texts[0] == texts[1] and texts[0]
    unauthorized = requests.post(f"{served['direct']}/completions", json=body, timeout=30)
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"
    bad = requests.post(f"{served['direct']}/completions", json={**body, "temperature": -1}, headers=AUTH, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert requests.get(served["direct"].removesuffix("/v1") + "/health", timeout=10).status_code == 200


def test_metrics_count_the_requests_of_every_api_server(served):
    """Each connection goes to the next API server: six fresh connections reach both, and the
    replica's /metrics (through the proxy and on the direct URL) counts all six."""
    proxy_metrics = served["proxy"].removesuffix("/v1") + "/metrics"
    direct_metrics = served["direct"].removesuffix("/v1") + "/metrics"
    def settled():          # the API servers' counts reach the replica within a second
        first = _success_count(requests.get(proxy_metrics, timeout=30).text)
        time.sleep(1.5)
        return (first,) if _success_count(requests.get(proxy_metrics, timeout=30).text) == first else None
    (before,) = _wait(settled, "the count settles")
    timed = ("mtpserve:request_queue_time_seconds_count", "mtpserve:request_prefill_time_seconds_count")
    timed_before = [_success_count(requests.get(direct_metrics, timeout=30).text, name) for name in timed]
    body = {"model": served["model"], "prompt": "x = ", "max_tokens": 2}
    for _ in range(6):                         # requests.post: a connection of its own each time
        assert requests.post(f"{served['direct']}/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    _wait(lambda: _success_count(requests.get(proxy_metrics, timeout=30).text) == before + 6,
          "the proxy's /metrics counts the six requests both API servers answered")
    _wait(lambda: _success_count(requests.get(direct_metrics, timeout=30).text) == before + 6,
          "the direct URL's /metrics counts them too, whichever API server answers it")
    for name, old in zip(timed, timed_before):   # the engine's times reach the API servers' histograms
        _wait(lambda name=name, old=old: _success_count(requests.get(direct_metrics, timeout=30).text, name) == old + 6,
              f"{name} counts the six requests")


def test_a_client_that_leaves_mid_stream_frees_its_request(served):
    (status,) = replica_statuses(APP).values()
    emitted = status["spec"]["num_emitted_tokens"]
    body = {"model": served["model"], "prompt": "def f():", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with requests.post(f"{served['direct']}/completions", json=body, headers=AUTH, stream=True, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith(b"data: {"))

    def idle():
        (status,) = replica_statuses(APP).values()
        return status if status["idle_and_empty"] else None
    status = _wait(idle, "the engine is idle again")
    assert status["integrity"] == "ok"
    assert status["spec"]["num_emitted_tokens"] - emitted < 900, "the request was aborted, not run to its end"


def _processes(marker: bytes) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_the_replica_its_engine_and_api_servers_run_at_nice_0_not_rays_15(served):
    """Ray starts workers at nice 15, below every ordinary process; the Ray that serve starts runs
    them at 0, so the replica and the processes it starts are not starved by the host's others."""
    engines, servers = _processes(b"mtpserve.actors.engine_process"), _processes(b"mtpserve.actors.api_servers")
    assert engines and servers
    replicas = [int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in engines]
    for pid in replicas + engines + servers:    # a replica is its engine process's parent
        assert os.getpriority(os.PRIO_PROCESS, pid) == 0, Path(f"/proc/{pid}/cmdline").read_bytes()[:80]


def test_stopping_serve_stops_the_api_servers(served):
    served["serve"].stop()
    assert served["serve"].proc.returncode == 0

    _wait(lambda: not _processes(b"mtpserve.actors.api_servers"), "no API server process is left", timeout=30)
    with pytest.raises(requests.ConnectionError):
        requests.get(served["direct"].removesuffix("/v1") + "/health", timeout=5)
