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

import json
import os

from mtpserve.actors.prefix_routing import SCOPE_KEY, prompt_head
from mtpserve.actors.protocol import SSE_DONE, APIError

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "mtpserve.actors.proxy_middleware:middlewares"
MAX_HEAD_BODY_BYTES = 1 << 20       # bodies the prompt-head middleware reads (larger ones: routed by load)
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


class ReplicaLossMiddleware:
    """Completes a generation response that the proxy left unstarted or cut short."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").endswith("/completions"):
            return await self.app(scope, receive, send)
        state = {"started": False, "sse": False, "ended": False}

        async def watch(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = dict(message.get("headers") or ())
                state["sse"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        await self.app(scope, receive, watch)
        if not state["started"]:
            err = replica_lost_error()
            body = json.dumps(err.body()).encode()
            await send({"type": "http.response.start", "status": err.status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        elif state["sse"] and not state["ended"]:
            event = f"data: {json.dumps(replica_lost_error().body())}\n\n{SSE_DONE}"
            await send({"type": "http.response.body", "body": event.encode()})


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
        head = prompt_head(body, chat) if not held else None
        if head is not None:
            scope = {**scope, SCOPE_KEY: head}
        replay = [{"type": "http.request", "body": body, "more_body": False}, *held]

        async def replayed():
            return replay.pop(0) if replay else await receive()
        return await self.app(scope, replayed, send)
