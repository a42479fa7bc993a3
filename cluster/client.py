"""Generating from Python through a Serve ``DeploymentHandle`` (no HTTP on the way).

From any process connected to the Ray cluster that runs the app (``ray.init(address=...)``)::

    from mtpserve.cluster.client import MTPClient

    client = MTPClient("mtpserve")                       # serve.get_app_handle("mtpserve")
    out = client.generate("def fib(n):", max_tokens=32, temperature=0)
    print(out.text, out.finish_reason, out.num_output_tokens)

    for event in client.stream("import ", max_tokens=64, session_id="chat-42"):
        print(event.text, end="", flush=True)            # engine TokenEvents

    out = await client.agenerate("x = ", max_tokens=8)    # inside asyncio
    async for event in client.astream("y = ", max_tokens=8): ...

Keyword arguments are ``SamplingParams`` fields (temperature, top_p, top_k, seed, max_tokens,
stop, stop_token_ids, ignore_eos); a bad value raises ``ValueError`` from the replica. A
``session_id`` keeps a conversation on one replica (the same affinity as the HTTP header
``x-session-id``). Leaving a stream early aborts the request on its replica.

The same calls work on the raw handle: ``handle.generate.remote(prompt, {"max_tokens": 8})`` and
``handle.options(stream=True).stream.remote(prompt, {...})``. ``replica_statuses(app)`` reads
every live replica's pools and integrity checks (for tests, benchmarks and operators).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator

from ray import serve

from mtpserve.actors.worker import Generation
from mtpserve.engine.request import TokenEvent


class MTPClient:
    """A typed wrapper over the application's DeploymentHandle."""

    def __init__(self, app_name: str = "mtpserve", handle=None):
        self.handle = handle if handle is not None else serve.get_app_handle(app_name)

    def _handle(self, session_id: str | None, stream: bool = False):
        options = {"stream": True} if stream else {}
        if session_id:
            options["session_id"] = session_id
        return self.handle.options(**options) if options else self.handle

    def generate(self, prompt: str | list[int], *, session_id: str | None = None, **sampling) -> Generation:
        """Run a request to the end (blocking)."""
        return self._handle(session_id).generate.remote(prompt, sampling, session_id).result()

    def stream(self, prompt: str | list[int], *, session_id: str | None = None, **sampling) -> Iterator[TokenEvent]:
        """Yield the request's TokenEvents as they are produced (blocking iterator)."""
        gen = self._handle(session_id, stream=True).stream.remote(prompt, sampling, session_id)
        try:
            yield from gen
        finally:
            gen.cancel()

    def export_prefix(self, prompt: str | list[int], *, session_id: str | None = None) -> list[tuple[bytes, bytes]]:
        """The cached prefix of ``prompt`` on the replica of ``session_id`` (msgpack records)."""
        return self._handle(session_id).export_prefix.remote(prompt).result()

    def import_prefix(self, records: list[tuple[bytes, bytes]], *, session_id: str | None = None) -> int:
        """Records from ``export_prefix`` into the cache of the replica of ``session_id``: a
        session's cached prefix moved to the replica it now lives on; the prompt tokens covered."""
        return self._handle(session_id).import_prefix.remote(records).result()

    async def agenerate(self, prompt: str | list[int], *, session_id: str | None = None, **sampling) -> Generation:
        return await self._handle(session_id).generate.remote(prompt, sampling, session_id)

    async def astream(self, prompt: str | list[int], *, session_id: str | None = None,
                      **sampling) -> AsyncIterator[TokenEvent]:
        gen = self._handle(session_id, stream=True).stream.remote(prompt, sampling, session_id)
        try:
            async for event in gen:
                yield event
        finally:
            gen.cancel()


def replica_statuses(app_name: str = "mtpserve", max_wait_s: float = 10.0) -> dict[str, dict]:
    """``engine_status`` of every replica in the planner's view, keyed by replica id.

    Each call goes to its replica through a fresh session bound in the planner's session table
    (the router follows the table from its next view refresh, a fraction of a second).
    """
    import ray

    from mtpserve.actors.planner import get_planner
    planner = get_planner(app_name)
    if planner is None:
        raise RuntimeError(f"no planner for the application {app_name!r}")
    handle = serve.get_app_handle(app_name)
    out = {}
    for rid in ray.get(planner.placement.remote(), timeout=30).replicas:
        sid = f"status-{rid}-{uuid.uuid4().hex[:6]}"
        ray.get(planner.bind_session.remote(sid, rid), timeout=30)
        deadline = time.monotonic() + max_wait_s
        while True:
            status = handle.options(session_id=sid).engine_status.remote().result()
            if status["replica_id"] == rid or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        if status["replica_id"] != rid:
            raise RuntimeError(f"the router did not follow the planner's session table to {rid}")
        out[rid] = status
    return out
