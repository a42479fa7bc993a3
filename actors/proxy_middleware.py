"""ASGI middlewares for Ray Serve's HTTP proxy: what a client sees when its replica dies, and
the prompt head that prefix-aware routing reads.

The OpenAI routes run on the replica itself (one hop for tokens), so when a replica's process
dies its in-flight requests die with it and nothing on the replica can answer them. Ray Serve's
proxy then says little: a request whose response had not started gets a bare
``500 Internal Server Error``; a stream that had started is cut off mid-chunk (clients report
an incomplete chunked read). In the proxy, this middleware turns both into OpenAI errors:

    no response yet        ->  503 {"error": {..., "code": "replica_unavailable"}}
    SSE stream cut short   ->  data: {"error": {..., "code": "replica_unavailable"}}
                               data: [DONE]

A 503 before the first token is safe to retry (the OpenAI clients do): the request ran nowhere
else. Only the generation routes (paths ending in ``/completions``) are touched.

A streamed request whose response has not started within ``stream_start_timeout_s`` (30 s;
``MTPSERVE_STREAM_START_TIMEOUT_S``, 0 turns it off) is cancelled and answered the same 503:
a replica starts a stream's response as soon as it has taken the request (before its first
token), so such a request is waiting on a replica that stopped, or in the proxy's queue with
every replica full. (Twice in CI a request routed to a replica 0.1 s before its node was marked
dead got no answer from Serve at all; the test gave up after 120 s. A third time, with this
limit in place, two such requests still hung: the 503 waited for the cancelled request to
unwind, and Serve's proxy catches a cancel (``send_request_to_replica`` takes any exception for
a response status; a cancel is a client that left, 499, answered with nothing) and goes on to its
cleanup, where a shielded wait on the lost replica's router can hold it; which wait held those
two was not caught. The 503 now goes out ``CANCEL_GRACE_S`` after the cancel at the latest, and
whatever the proxy sends after it is dropped.) Whether a request streams
is read from the body the prompt-head middleware parses (bodies up to ``MAX_HEAD_BODY_BYTES``).

``ViaProxyMiddleware`` marks the generation requests it forwards, so their replica paces the
stream's chunks (each one a Ray message from replica to proxy).

``PromptHeadMiddleware``: the router that picks a replica for an HTTP request runs in this proxy
but gets the request's ASGI scope, not its body (the body follows to the replica afterwards). For
``POST .../v1/completions`` and ``.../v1/chat/completions`` with a body of at most
``MAX_HEAD_BODY_BYTES`` it reads the body, puts the first part of the prompt under
``scope[prefix_routing.SCOPE_KEY]`` (``prefix_routing.prompt_head``: a few KB at most) and hands
the replica the same body, byte for byte. Larger bodies, other routes and bodies that are not
such requests pass untouched (routed by load). The body is read before the replica checks the
API key, so an unauthenticated client costs the proxy one JSON parse of at most that size.

Serve builds its proxies' middlewares from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` in the
environment of each node's Ray processes: set it to ``PROXY_CALLBACK`` on every node where
mtpserve is installed (``ray start``, the RayService pods), or call ``install()`` before
``ray.init`` starts a local cluster.
"""

from __future__ import annotations

import asyncio
import json
import os

from mtpserve.actors.prefix_routing import SCOPE_KEY, prompt_head
from mtpserve.actors.protocol import SSE_DONE, APIError

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "mtpserve.actors.proxy_middleware:middlewares"
MAX_HEAD_BODY_BYTES = 1 << 20       # bodies the prompt-head middleware reads (larger ones: routed by load)
STREAM_START_TIMEOUT_ENV = "MTPSERVE_STREAM_START_TIMEOUT_S"
DEFAULT_STREAM_START_TIMEOUT_S = 30.0
CANCEL_GRACE_S = 1.0                # how long a cancelled request may take to unwind before the 503 goes out
STATE_KEY = "mtpserve.response"     # scope entry: the replica-loss middleware's record of the response
REPLICA_LOST = ("the replica serving this request stopped before it finished; "
                "other replicas are unaffected, retry the request")


def install(environ=os.environ) -> None:
    """Ask the proxies of a Ray started after this call (from this process) to use the middleware."""
    environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)


def middlewares() -> list:
    """Serve's proxy callback: the middlewares to wrap its ASGI app with. None in a replica,
    which calls it too for its own HTTP port (direct ingress): there the replica answers for
    itself and nothing routes, and each streamed chunk would pay one more wrapper."""
    from ray.serve.context import _get_internal_replica_context
    if _get_internal_replica_context() is not None:
        return []
    from starlette.middleware import Middleware
    return [Middleware(ReplicaLossMiddleware), Middleware(PromptHeadMiddleware), Middleware(ViaProxyMiddleware)]


VIA_PROXY_HEADER = "x-mtpserve-via-proxy"     # set by the proxy on the generation routes


class ViaProxyMiddleware:
    """Marks a generation request that the proxy forwards (``VIA_PROXY_HEADER``): its replica
    then paces the stream's chunks (``proxy_chunks_per_s``), each of which costs a Ray
    message between the two. A client sending the header itself only gets paced chunks."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "").endswith("/completions"):
            scope = {**scope, "headers": [*scope.get("headers", ()), (VIA_PROXY_HEADER.encode(), b"1")]}
        return await self.app(scope, receive, send)


def replica_lost_error() -> APIError:
    return APIError(503, REPLICA_LOST, "server_error", None, "replica_unavailable")


def stream_start_timeout_s(environ=os.environ) -> float:
    """``MTPSERVE_STREAM_START_TIMEOUT_S`` (seconds; 0 or less: no limit), else the default."""
    value = environ.get(STREAM_START_TIMEOUT_ENV)
    if value is None or not value.strip():
        return DEFAULT_STREAM_START_TIMEOUT_S
    try:
        return max(0.0, float(value))
    except ValueError:
        raise ValueError(f"{STREAM_START_TIMEOUT_ENV} must be a number of seconds, got {value!r}") from None


def stream_not_started_error(timeout_s: float) -> APIError:
    return APIError(503, f"no replica started this streamed request within {timeout_s:g} s (the replica it went "
                         "to stopped, or every replica is full); it was cancelled before it ran: retry it",
                    "server_error", None, "replica_unavailable")


class ReplicaLossMiddleware:
    """Completes a generation response that the proxy left unstarted or cut short, and answers a
    stream whose response has not started within ``start_timeout_s`` (see the module docstring)."""

    def __init__(self, app, start_timeout_s: float | None = None):
        self.app = app
        self.start_timeout_s = stream_start_timeout_s() if start_timeout_s is None else start_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").endswith("/completions"):
            return await self.app(scope, receive, send)
        state = {"sse": False, "ended": False, "stream": False, "answered": False}
        started = asyncio.Event()             # the response started

        async def watch(message):
            if state["answered"]:             # this middleware answered for the app: drop what it sends
                return
            if message["type"] == "http.response.start":
                started.set()
                headers = dict(message.get("headers") or ())
                state["sse"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        if self.start_timeout_s > 0:
            if not await self._started_in_time({**scope, STATE_KEY: state}, receive, watch, started, state):
                return await _send_error(send, stream_not_started_error(self.start_timeout_s))
        else:
            await self.app(scope, receive, watch)
        if not started.is_set():
            await _send_error(send, replica_lost_error())
        elif state["sse"] and not state["ended"]:
            event = f"data: {json.dumps(replica_lost_error().body())}\n\n{SSE_DONE}"
            await send({"type": "http.response.body", "body": event.encode()})

    async def _started_in_time(self, scope, receive, watch, started: asyncio.Event, state: dict) -> bool:
        """Run the app; False when it was cancelled because the request streams and its
        response had not started within ``start_timeout_s`` (a request that does not stream, or
        whose response started, runs to its end)."""
        task = asyncio.ensure_future(self.app(scope, receive, watch))
        waiter = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait({task, waiter}, timeout=self.start_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not started.is_set() and state["stream"]:   # (state: marked by the prompt-head one)
                state["answered"] = True
                task.cancel()
                # Serve's proxy catches the cancel and may then wait on the lost replica in a
                # shielded cleanup: the client is answered after a short grace (anything the
                # proxy sends from now on is dropped by watch), and the task unwinds on its own
                await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
                task.add_done_callback(_retrieve)
                return False
            await task
            return True
        except asyncio.CancelledError:          # the client went away: so does the request
            task.cancel()
            raise
        finally:
            waiter.cancel()


def _retrieve(task: asyncio.Task) -> None:
    """(A cancelled app task's outcome, read so that asyncio does not log it as never retrieved.)"""
    if not task.cancelled():
        task.exception()


async def _send_error(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class PromptHeadMiddleware:
    """Puts a generation request's prompt head in its scope for the router (see the module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        chat = path.endswith("/v1/chat/completions")
        if not (chat or path.endswith("/v1/completions")) or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if not length.isdigit() or int(length) > MAX_HEAD_BODY_BYTES:
            return await self.app(scope, receive, send)
        chunks, held = [], []              # held: what arrived after the body (a disconnect)
        while True:
            message = await receive()
            if message["type"] != "http.request":
                held.append(message)
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        request = None
        if not held:
            try:
                request = json.loads(body)
            except (ValueError, RecursionError):   # the replica answers such a body itself (400)
                pass
        head = prompt_head(request, chat) if isinstance(request, dict) else None
        if head is not None:
            scope = {**scope, SCOPE_KEY: head}
        response = scope.get(STATE_KEY)
        if response is not None and isinstance(request, dict) and request.get("stream") is True:
            response["stream"] = True           # (the replica-loss middleware's start limit applies)
        replay = [{"type": "http.request", "body": body, "more_body": False}, *held]

        async def replayed():
            return replay.pop(0) if replay else await receive()
        return await self.app(scope, replayed, send)
