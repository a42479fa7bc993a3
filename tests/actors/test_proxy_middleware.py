"""The proxy's middlewares as Serve's proxy chains them (``proxy_middleware.middlewares``), around
stand-in ASGI apps in the roles of Serve's proxy app: what a client sees when no replica
answers a stream, when the answer is slow, and when a replica drops a request."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from mtpserve.actors.proxy_middleware import (
    REPLICA_LOST,
    STREAM_START_TIMEOUT_ENV,
    PromptHeadMiddleware,
    ReplicaLossMiddleware,
    ViaProxyMiddleware,
    stream_start_timeout_s,
)


def _chain(app, timeout_s: float):
    """The proxy's chain (outermost first), as ``middlewares()`` orders it."""
    return ReplicaLossMiddleware(PromptHeadMiddleware(ViaProxyMiddleware(app)), start_timeout_s=timeout_s)


def _call(app, body: dict, path: str = "/v1/completions"):
    """One request through ``app``: (status, response headers, body bytes, seconds)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    sent = [{"type": "http.request", "body": raw, "more_body": False}]
    out = {"status": None, "headers": {}, "body": b""}

    async def receive():
        if sent:
            return sent.pop(0)
        await asyncio.sleep(3600)             # (the client stays)

    async def send(message):
        if message["type"] == "http.response.start":
            assert out["status"] is None, "the response started twice"
            out["status"], out["headers"] = message["status"], dict(message.get("headers") or ())
        else:
            out["body"] += message.get("body", b"")

    started = time.perf_counter()
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))       # (a broken rule fails, not hangs)
    return out["status"], out["headers"], out["body"], time.perf_counter() - started


class Never:
    """A proxy app routed to a replica that never answers (its node died unannounced).
    ``swallows``: in the role of Serve's proxy on a lost replica, it catches the cancel (as its
    ``send_request_to_replica`` catches any exception), answers it (Serve 2.60 sends nothing for
    a cancel; another version's answer must not reach the client either), and then waits in a
    shielded cleanup that the lost replica never finishes."""

    def __init__(self, swallows: bool = False):
        self.swallows, self.cancelled = swallows, False

    async def __call__(self, scope, receive, send):
        await receive()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            if not self.swallows:
                raise
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b"Internal Server Error"})
            await asyncio.shield(asyncio.sleep(3600))


def answering(after_s: float, stream: bool):
    """A proxy app whose replica starts its response after ``after_s`` (an SSE stream of two
    events, or one JSON body) and takes as long again to finish it."""
    async def app(scope, receive, send):
        await receive()
        await asyncio.sleep(after_s)
        kind = b"text/event-stream" if stream else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": b'data: {"n": 1}\n\n' if stream else b'{"n": 1}',
                    "more_body": stream})
        if stream:
            await asyncio.sleep(after_s)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    return app


def test_a_stream_no_replica_starts_gets_a_retryable_503_within_the_limit_and_is_cancelled():
    app = Never()
    status, headers, body, seconds = _call(_chain(app, 0.3), {"model": "m", "prompt": "hi", "stream": True})
    assert status == 503 and headers[b"content-type"] == b"application/json"
    error = json.loads(body)["error"]
    assert error["code"] == "replica_unavailable" and "retry" in error["message"] and "0.3 s" in error["message"]
    assert 0.3 <= seconds < 2.0
    assert app.cancelled, "the request was left waiting in the proxy"


def test_a_stream_the_proxy_cannot_unwind_still_gets_the_503_and_not_the_proxys_500():
    app = Never(swallows=True)
    status, _, body, seconds = _call(_chain(app, 0.3), {"model": "m", "prompt": "hi", "stream": True})
    assert status == 503 and json.loads(body)["error"]["code"] == "replica_unavailable"
    assert app.cancelled and 0.3 <= seconds < 3.0


def test_requests_that_start_late_or_do_not_stream_run_to_their_end():
    # a stream that starts inside the limit runs past it; a request without a stream starts only
    # when it is done (a long generation), so the limit does not apply to it
    status, headers, body, seconds = _call(_chain(answering(0.2, stream=True), 0.3),
                                           {"model": "m", "prompt": "hi", "stream": True})
    assert status == 200 and body == b'data: {"n": 1}\n\ndata: [DONE]\n\n' and seconds >= 0.4
    status, _, body, seconds = _call(_chain(answering(0.5, stream=False), 0.3),
                                     {"model": "m", "prompt": "hi", "stream": False})
    assert status == 200 and body == b'{"n": 1}' and seconds >= 0.5
    # with the limit off, a stream that starts late is waited for too
    status, _, body, _ = _call(_chain(answering(0.5, stream=True), 0), {"model": "m", "prompt": "hi", "stream": True})
    assert status == 200 and body.endswith(b"[DONE]\n\n")


def test_a_request_the_proxy_leaves_unanswered_or_cut_short_gets_the_replica_lost_error():
    async def bare(scope, receive, send):          # Serve's proxy after the replica died: nothing sent
        await receive()

    async def torn(scope, receive, send):          # ... or a stream cut off mid-way
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"n": 1}\n\n', "more_body": True})

    status, _, body, _ = _call(_chain(bare, 0.3), {"model": "m", "prompt": "hi", "stream": False})
    assert status == 503 and json.loads(body)["error"]["message"] == REPLICA_LOST
    status, _, body, _ = _call(_chain(torn, 0.3), {"model": "m", "prompt": "hi", "stream": True})
    events = body.decode().split("\n\n")
    assert status == 200 and json.loads(events[1][len("data: "):])["error"]["code"] == "replica_unavailable"
    assert events[2] == "data: [DONE]"


def test_the_limit_comes_from_the_environment():
    assert stream_start_timeout_s({}) == 30.0
    assert stream_start_timeout_s({STREAM_START_TIMEOUT_ENV: "2.5"}) == 2.5
    assert stream_start_timeout_s({STREAM_START_TIMEOUT_ENV: "0"}) == 0.0
    with pytest.raises(ValueError, match=STREAM_START_TIMEOUT_ENV):
        stream_start_timeout_s({STREAM_START_TIMEOUT_ENV: "soon"})
