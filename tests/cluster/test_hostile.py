"""Hostile and malformed requests against `mtpserve serve` (issue 14): each is refused with a clear
OpenAI error envelope (never a hang, a crash or a 5xx), and afterwards the server is healthy:
/health answers, a normal completion works, and every replica's pools pass their integrity
checks and are idle (no leaked blocks or state rows).

Issue 14's items and where each is tested:

    1  oversized prompts stall nothing            test_oversized_bodies_and_prompts_stall_nothing
    2  the API key before the body is parsed      test_the_api_key_is_checked_before_the_body_is_read
    3  never touching a cluster it did not start  test_serving_onto_a_taken_name_or_prefix_touches_nothing
                                                 (+ test_serve.py::test_without_address_serve_starts_its_own_ray...)
    4  an envelope on every answer               test_malformed_requests_get_the_envelope_and_no_internals
    5  the local Ray on loopback                 not possible with Ray 2.60: its raylet and GCS add a
                                                 0.0.0.0 / :: listener whatever the node address (README)
    6  a truncated model: one line, rc 2         test_cli.py::test_serve_refuses_a_truncated_model_in_one_line...
    7  a bounded drain on SIGINT                 test_serve.py::test_ctrl_c_shuts_down_cleanly
    8  every error counted by status             test_every_refusal_is_counted_by_status (last here)
    9  session ids and tables bounded            test_session_ids_are_bounded
                                                 (+ test_planner_state.py for the table's LRU bound)
   10  the Bearer scheme and the key comparison  test_the_api_key_scheme_is_case_insensitive...
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

requests = pytest.importorskip("requests")

from serve_process import start_serve  # noqa: E402

APP, KEY = "hostile", "hostile-key"
BODY_LIMIT = 1 << 20              # --max-request-bytes: 1 MiB, so oversized bodies stay cheap to send
CONTEXT = 96                      # --max-model-len: whatever the fuzzer asks for, a request stays short
FUZZ_EXAMPLES = 60                # schemathesis examples per operation
FUZZ_SEED = 14                    # the same examples on every run (CI must not depend on luck); change it
                                  # locally to explore: unseeded runs found the echo + huge-id 500
ENVELOPE = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    served = start_serve(ray_cluster, model_dir, APP, "--api-key", KEY, "--num-threads", "1", "--shutdown-grace-s", "1",
                         "--max-request-bytes", str(BODY_LIMIT), "--max-model-len", str(CONTEXT))
    root = ray_cluster["url"]
    yield {"root": root, "url": f"{root}/v1/completions", "model": served.model,
           "host": root.split("//")[1].rsplit(":", 1)[0], "port": int(root.rsplit(":", 1)[1])}
    served.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


def _assert_envelope(r, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == ENVELOPE, r.text[:300]
    assert ".py" not in r.text and "Traceback" not in r.text and "pydantic" not in r.text.lower(), r.text[:300]
    if param is not None:
        assert err["param"] == param, err
    return err


def _assert_healthy(server) -> None:
    """/health, a normal completion, then every replica idle with intact pools."""
    from mtpserve.cluster.client import replica_statuses
    assert requests.get(f"{server['root']}/health", timeout=30).json()["status"] == "ok"
    r = requests.post(server["url"], headers=AUTH, timeout=60,
                      json={"model": server["model"], "prompt": "def f(x):", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    deadline = time.monotonic() + 20
    while True:         # aborted streams are released between steps: give them a moment
        statuses = replica_statuses(APP)
        if all(s["idle_and_empty"] for s in statuses.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    for s in statuses.values():
        assert s["integrity"] == "ok" and s["idle_and_empty"], s


def _post_raw(server, body: bytes, headers: dict) -> tuple[int, bytes]:
    """One POST over a raw socket (no client library to fix up the framing); (status, body)."""
    with socket.create_connection((server["host"], server["port"]), timeout=60) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}\r\n".encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def test_oversized_bodies_and_prompts_stall_nothing(server):
    """Item 1: bodies over the limit get 413 unread; prompts under it that cannot fit the
    context get 400 without being tokenized, or tokenized off the event loop; while several
    such requests are in flight, /health and a normal request answer at once."""
    url, model = server["url"], server["model"]
    over = {"model": model, "prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}
    under = {"model": model, "prompt": "ab " * (BODY_LIMIT // 3 - 40), "max_tokens": 1}

    def send(body):
        return requests.post(url, json=body, headers=AUTH, timeout=60)
    with ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(send, over) for _ in range(4)] + [pool.submit(send, under) for _ in range(4)]
        t0 = time.monotonic()
        health = requests.get(f"{server['root']}/health", timeout=30)
        health_s = time.monotonic() - t0
        results = [f.result() for f in pending]
    assert health.json()["status"] == "ok" and health_s < 5, health_s
    for r in results[:4]:
        assert _assert_envelope(r, 413)["code"] == "request_too_large"
    for r in results[4:]:
        _assert_envelope(r, 400, "prompt")
    _assert_healthy(server)


def test_the_api_key_is_checked_before_the_body_is_read(server):
    """Item 2: no key or a wrong one is a 401 whatever the body (oversized, broken, unframed);
    a body without a Content-Length is a 411; the server keeps answering."""
    url = server["url"]
    junk = b"{" * (BODY_LIMIT + 1)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: requests.post(url, data=junk, timeout=60,
                                                        headers={"Content-Type": "application/json"}), range(24)))
    for r in answers:
        assert _assert_envelope(r, 401)["code"] == "invalid_api_key"
    r = requests.post(url, data=b"{not json", headers={"Authorization": "Bearer wrong"}, timeout=60)
    _assert_envelope(r, 401)
    status, body = _post_raw(server, b"5\r\n{\"a\":\r\n0\r\n\r\n",
                             {**AUTH, "Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    assert status == 411 and set(json.loads(body)["error"]) == ENVELOPE
    _assert_healthy(server)


def test_malformed_requests_get_the_envelope_and_no_internals(server):
    """Item 4: lone surrogates, invalid UTF-8, deep nesting, wrong types, an empty body, unknown
    paths and methods, and a request that could never be queued: each a 4xx envelope."""
    url, model = server["url"], server["model"]
    for field in ("prompt", "model"):
        raw = json.dumps({"model": model, "prompt": "x", "max_tokens": 1}).replace(f'"{field}": "', f'"{field}": "\\udc00', 1)
        _assert_envelope(requests.post(url, data=raw, headers={**AUTH, "Content-Type": "application/json"},
                                       timeout=30), 400, field)
    bad_bodies = [b'{"model": "m", "prompt": "\xff\xfe"}', b"[" * 50_000 + b"]" * 50_000, b"", b"null",
                  b'{"model": 1', b"[1, 2]"]
    for raw in bad_bodies:
        _assert_envelope(requests.post(url, data=raw, headers={**AUTH, "Content-Type": "application/json"},
                                       timeout=30), 400)
    for params, param in ((dict(prompt=[5, True]), "prompt"), (dict(prompt=["7", 7]), "prompt"), (dict(max_tokens="4"), "max_tokens"),
                          (dict(max_tokens=True), "max_tokens"), (dict(n=1.5), "n"), (dict(temperature="hot"), "temperature"),
                          (dict(prompt=[[1, 2], 3]), "prompt"), (dict(stream_options={"include_usage": "yes"}),
                                                                  "stream_options.include_usage")):
        body = {"model": model, "prompt": "x", "max_tokens": 1, **params}
        _assert_envelope(requests.post(url, json=body, headers=AUTH, timeout=30), 400, param)
    for prompt in ([2**80, 5], [[3, 4], [-1]]):     # found by the fuzzer: with echo, a 500 decoding an id out of range
        _assert_envelope(requests.post(url, json={"model": model, "prompt": prompt, "echo": True, "max_tokens": 1},
                                       headers=AUTH, timeout=30), 400, "prompt")
    err = _assert_envelope(requests.post(url, json={"model": model, "prompt": ["x"] * 600, "n": 2, "max_tokens": 1},
                                         headers=AUTH, timeout=30), 400)
    assert "queues" in err["message"], "more than a replica can ever queue is a 400, not a retryable 429"
    for method, path, status in (("GET", "/v1/nowhere", 404), ("POST", "/nowhere", 404),
                                 ("DELETE", "/v1/completions", 405), ("PUT", "/v1/chat/completions", 405)):
        _assert_envelope(requests.request(method, server["root"] + path, headers=AUTH, timeout=30), status)
    _assert_healthy(server)


def test_serving_onto_a_taken_name_or_prefix_touches_nothing(server, ray_cluster, model_dir):
    """Item 3: `mtpserve serve --address` onto a cluster where an application of the same name, or
    another one at the route prefix, already runs refuses in one line (rc 2) before deploying,
    and the running application keeps serving (serve.run would have replaced it)."""
    port = ray_cluster["url"].rsplit(":", 1)[1]
    for name, says in ((APP, "already runs"), ("intruder", "already serves the route prefix")):
        proc = subprocess.run([sys.executable, "-m", "mtpserve.cluster.serve", "--address", ray_cluster["address"],
                               "--port", port, "--model", str(model_dir), "--app-name", name],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    _assert_healthy(server)


def test_the_api_key_scheme_is_case_insensitive_and_near_misses_are_refused(server):
    """Item 10: `bearer` in any case and extra spaces are the scheme; a key off by one
    character, another scheme or a bare key are 401s."""
    def status(authorization):
        headers = {} if authorization is None else {"Authorization": authorization}
        return requests.post(server["url"], headers=headers, timeout=60,
                             json={"model": server["model"], "prompt": "x = ", "max_tokens": 1}).status_code
    assert status(f"bearer {KEY}") == status(f"BEARER  {KEY}") == status(f"Bearer {KEY}") == 200
    for wrong in (None, f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer", "Bearer "):
        assert status(wrong) == 401, wrong


def test_session_ids_are_bounded(server):
    """Item 9: a session id over 256 characters is a 400 naming the header; many distinct ids of
    the longest allowed length are served (the planner's table is bounded: test_planner_state)."""
    body = {"model": server["model"], "prompt": "x = ", "max_tokens": 1}
    r = requests.post(server["url"], json=body, headers={**AUTH, "x-session-id": "s" * 257}, timeout=30)
    _assert_envelope(r, 400, "x-session-id")
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: requests.post(server["url"], json=body, timeout=60, headers={
            **AUTH, "x-session-id": f"{i:04d}" + "s" * 252}).status_code, range(64)))
    assert codes == [200] * 64
    _assert_healthy(server)


@pytest.fixture(scope="module")
def api_schema(server):
    schemathesis = pytest.importorskip("schemathesis")
    return schemathesis.openapi.from_url(f"{server['root']}/openapi.json")


def test_the_published_schema_says_what_the_server_does(api_schema, server):
    """Errors are documented as the envelope with their real statuses (400, never FastAPI's 422)
    and `model` is the served model's name, so a schema-driven client or fuzzer can reach the model."""
    raw = requests.get(f"{server['root']}/openapi.json", timeout=30).json()
    post = raw["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in post and {"200", "400", "401", "413", "429"} <= set(post)
    assert raw["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == [server["model"]]


def test_schemathesis_finds_no_server_error_and_no_undocumented_status(api_schema, server, tmp_path):
    """Schema-driven fuzzing of every route (valid and invalid bodies, FUZZ_EXAMPLES each): never a
    5xx, only documented statuses, every error in the envelope. Its own process: onnxruntime,
    loaded by earlier tests, turns on flush-to-zero, and hypothesis then refuses to make floats."""
    proc = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{server['root']}/openapi.json",
         "--checks", "not_a_server_error,status_code_conformance", "--max-examples", str(FUZZ_EXAMPLES),
         "--header", f"Authorization: Bearer {KEY}", "--suppress-health-check", "all", "--no-color",
         "--seed", str(FUZZ_SEED)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)     # its cache stays out of the checkout
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_every_refusal_is_counted_by_status(server):
    """Item 8 (runs last: the refusals above are on /metrics, each under its status)."""
    metrics = requests.get(f"{server['root']}/metrics", timeout=30).text
    errors = [line for line in metrics.splitlines() if line.startswith("mtpserve:request_errors_total")]
    for status in ("400", "401", "404", "405", "411", "413"):
        assert any(f'status="{status}"' in line for line in errors), (status, errors)
