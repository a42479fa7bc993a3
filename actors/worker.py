"""The worker: a Ray Serve replica that owns one engine and serves it over HTTP and handles.

One replica per GPU (``num_gpus=1``) or N CPU replicas. The replica

- builds an ``Engine`` and runs it on an ``EngineLoop`` (one owner thread);
- serves the OpenAI routes itself (``ingress.OpenAIRoutes``), so an HTTP request takes one hop,
  proxy -> replica (a separate ingress deployment would add a second hop, about 8 ms more to the
  first token on 2 cores), and Python callers use ``generate`` / ``stream`` on a handle;
- reports a full snapshot to the planner actor every ``report_interval_s`` from a thread of its
  own and applies the plan in the reply (grant, per-request draft counts); the first report is
  answered before the constructor returns, so a replica is in the routers' view once it serves;
- answers Serve's ``record_routing_stats`` (free blocks and rows, queue, sessions) for routers
  and ``check_health`` (a failed engine restarts the replica);
- when Serve stops it gracefully (``__del__``, after the drain), hands its sessions' cached
  prefixes to the planner, and imports those a stopped replica handed over for a session before
  that session's first request here (``actors/handover.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import operator
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from mtpserve.actors.api_servers import ApiServers
from mtpserve.actors.engine_loop import EngineLoop, RequestStream, merge_streams
from mtpserve.actors.engine_process import EngineProcess
from mtpserve.actors.handover import Records, records_size
from mtpserve.actors.ingress import OpenAIRoutes, api, guard
from mtpserve.actors.metrics import MetricsRecorder, MetricsSnapshot, merge_metrics, render_metrics
from mtpserve.actors.planner import WorkerReport, get_or_create_planner, get_planner
from mtpserve.actors.sessions import check_session_id
from mtpserve.actors.worker_config import WorkerConfig
from mtpserve.engine.bundled import resolve_model_dir
from mtpserve.engine.engine import Engine
from mtpserve.engine.grammar import GrammarCompiler
from mtpserve.engine.request import FinishReason, TokenEvent
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.tokenizer import Tokenizer

logger = logging.getLogger("ray.serve")

ROUTER_CLASS = "mtpserve.actors.router.StateAffinityRouter"
HANDOVER_CALL_BYTES = 64 << 20      # records per hand_over call at most (a larger session goes alone)
FIRST_REPORT_TIMEOUT_S = 30.0       # the longest a starting replica waits to be in the planner's view
TAKE_TIMEOUT_S = 10.0               # the longest a request waits for its session's handed-over records


def router_config(router_kwargs: dict | None = None) -> RequestRouterConfig:
    """Serve's routing settings of the deployment: our router (``router_kwargs`` reach its
    ``initialize_state``: the model, prefix-aware routing on or off), replica stats every 0.5 s."""
    return RequestRouterConfig(request_router_class=ROUTER_CLASS, request_routing_stats_period_s=0.5,
                               request_router_kwargs=router_kwargs or {})


@dataclass
class Generation:
    """A finished request, as ``generate`` returns it to Python callers."""
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    replica_id: str


class Worker:
    """The replica's logic (the Serve deployment ``LLMServer`` below adds the HTTP routes)."""

    def __init__(self, config: dict | WorkerConfig):
        cfg = config if isinstance(config, WorkerConfig) else WorkerConfig.from_dict(config)
        self.config = cfg = dataclasses.replace(cfg, engine=dataclasses.replace(
            cfg.engine, model_dir=resolve_model_dir(cfg.engine.model_dir)))   # the bundled model: this node's copy
        try:
            ctx = serve.get_replica_context()
            self.replica_id, self.app_name = ctx.replica_id.unique_id, ctx.app_name
        except Exception:             # outside Serve (tests, benchmarks): no planner
            self.replica_id, self.app_name = "local", None
        self.incarnation = uuid.uuid4().hex
        num_api_servers = cfg.num_api_servers
        if num_api_servers and not cfg.uses_engine_process:
            raise ValueError("api_servers needs the engine in a process of its own (engine_process on)")
        if cfg.uses_engine_process:                  # no GIL shared with the serving below
            loop = EngineProcess(cfg.engine, cfg.max_pending, num_clients=num_api_servers,
                                 stall_phases=cfg.stall_phases).start()
        else:
            loop = EngineLoop.launch(lambda: Engine(cfg.engine), max_pending=cfg.max_pending,
                                     stall_phases=cfg.stall_phases).start()
        self._init_serving(cfg, loop)
        self._actor_name = ray.get_runtime_context().get_actor_name() if self.app_name is not None else None
        self._reporter = None
        self._handover_version = None
        self.api_servers = None                  # the replica's own HTTP server processes, if any
        if num_api_servers:
            self.api_servers = ApiServers(self, num_api_servers, cfg.api_host, cfg.api_port).start()
            logger.info(f"{num_api_servers} API servers serve this replica at {self.api_servers.url}")
        if self.app_name is not None:
            reported = threading.Event()
            self._reporter = threading.Thread(target=self._report_loop, args=(reported,), name="mtpserve-report",
                                              daemon=True)
            self._reporter.start()
            # in the planner's view before Serve marks this replica ready: routers see it from its
            # first request, and it serves under its grant from its first step
            if not reported.wait(FIRST_REPORT_TIMEOUT_S):
                logger.warning(f"the planner did not answer in {FIRST_REPORT_TIMEOUT_S:.0f} s; serving, "
                               "the reports go on retrying")

    def _init_serving(self, cfg: WorkerConfig, loop: EngineLoop | EngineProcess) -> None:
        """The serving side over ``loop`` (an EngineLoop, or an EngineProcess started or attached):
        tokenizer, grammar compiler, limits, API key, metrics. The replica's, and its API servers'."""
        self.loop = loop
        if isinstance(loop, EngineLoop):
            self.engine = loop.engine
            m, self.tokenizer, self.grammar_compiler = self.engine.manifest, self.engine.tokenizer, \
                self.engine.grammars.compiler
        else:
            self.engine, m = None, loop.manifest
            self.tokenizer = Tokenizer(m.path)
            # the serving edge compiles each grammar once to refuse a bad one with a 400; the engine
            # process compiles (from its own cache) the ones that pass
            self.grammar_compiler = GrammarCompiler(m.path / "tokenizer.json", m.vocab_size, m.eos_token_ids)
        self.grammar_compiler.preload()              # structured output's library, before serving
        gc.freeze()      # what start-up built lives as long as the process: no collection rescans it
        self.manifest, self.limits, self.max_drafts = m, loop.limits, loop.max_drafts
        self.model_name = cfg.served_model_name
        self.context_length = m.context_length
        self.api_key = cfg.api_key or os.environ.get("MTPSERVE_API_KEY") or None
        self.recorder = MetricsRecorder()
        guard(self)                                  # API key and body limit before any parse
        self.policy = loop.policy                    # the adaptive policy, when draft_tokens is None
        self._stopping = threading.Event()
        self._num_open_streams = 0               # streams being read here (``run``)
        self._planner = None                     # the planner actor's handle, once known
        self._handed_over: frozenset[str] = frozenset()   # sessions the planner holds records of (its plan)

    # ------------------------------------------------------------------ requests
    async def open(self, request_id: str, prompts: list[list[int]], params: list[list[SamplingParams]],
                   session_id: str | None = None) -> list[RequestStream]:
        """Submit every (prompt, choice) as one engine request, all or none (errors propagate). A
        session whose cached prefix a stopped replica handed over gets it first (``take_handover``)."""
        check_session_id(session_id)
        if session_id and session_id in self._handed_over:
            await self.take_handover(session_id)
        streams = self.loop.submit_all([(f"{request_id}-{p}-{c}", ids, sp)
                                        for p, (ids, choice_params) in enumerate(zip(prompts, params))
                                        for c, sp in enumerate(choice_params)], session_id)
        first = 0
        for choice_params in params:          # a prompt's tokens count once, with its first choice (as usage)
            for stream in streams[first + 1:first + len(choice_params)]:
                stream.counts_prompt = False
            first += len(choice_params)
        return streams

    async def run(self, streams: list[RequestStream], started: float,
                  paced: bool = False) -> AsyncIterator[tuple[int, TokenEvent]]:
        """Merge the streams, recording TTFT, inter-token latency and finished requests.
        ``paced``: each read leaves as a Ray message of its own (through Serve's proxy, or a
        Python handle's stream): each stream is read at most every (streams open here) /
        ``proxy_chunks_per_s`` seconds.

        Each stream (one choice of one prompt) is recorded once as a finished request: with its
        finish reason, or as "abort" when the reading ends first (a client that went away: its
        request is cancelled), with the tokens it had sent. A prompt's tokens are counted once,
        with its first choice, as the response's usage counts them."""
        last_at: dict[int, float] = {}           # stream index -> time of its last token event
        counts: dict[int, tuple[int, int]] = {}  # stream index -> (prompt, output tokens) of its latest event
        finished: set[int] = set()
        self._num_open_streams += len(streams)
        rate = self.config.proxy_chunks_per_s
        if paced and rate > 0:
            for stream in streams:
                stream.pace = lambda: self._num_open_streams / rate
        try:
            async for i, event in merge_streams(streams):
                now = time.perf_counter()
                if event.token_ids:
                    if i not in last_at:
                        self.recorder.observe_ttft(now - started)
                        if event.queue_s is not None:
                            self.recorder.observe_admission(event.queue_s, event.prefill_s)
                    else:
                        self.recorder.observe_itl(now - last_at[i])
                    last_at[i] = now
                counts[i] = (event.num_prompt_tokens or counts.get(i, (0, 0))[0], event.num_output_tokens)
                if event.finish_reason is not None:
                    finished.add(i)
                    self._record_finished(streams[i], event.finish_reason.value, *counts[i], now - started)
                yield i, event
        finally:
            self._num_open_streams -= len(streams)
            now = time.perf_counter()
            for i in set(range(len(streams))) - finished:
                self._record_finished(streams[i], FinishReason.ABORT.value, *counts.get(i, (0, 0)), now - started)

    def _record_finished(self, stream: RequestStream, reason: str, num_prompt_tokens: int, num_output_tokens: int,
                         seconds: float) -> None:
        """One choice finished; its prompt's tokens count with the prompt's first choice only."""
        self.recorder.request_finished(reason, num_prompt_tokens if stream.counts_prompt else 0, num_output_tokens,
                                       seconds)

    def check_context(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ValueError when the prompt and ``max_tokens`` do not fit the context: refused, as vLLM
        does, never answered shorter."""
        if num_prompt_tokens >= self.context_length:             # no max_tokens could fit
            raise ValueError(f"this model's context is {self.context_length} tokens and the prompt has "
                             f"{num_prompt_tokens}: shorten it")
        if num_prompt_tokens + max_tokens > self.context_length:
            raise ValueError(f"this model's context is {self.context_length} tokens; the prompt's "
                             f"{num_prompt_tokens} plus max_tokens {max_tokens} exceed it: lower max_tokens")

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The most a request may generate: to the context end, within one replica's KV cache."""
        return max(1, self.limits.max_sequence_tokens - num_prompt_tokens)

    # ------------------------------------------------------------------ Python handle surface
    async def generate(self, prompt: str | list[int], sampling: dict | None = None,
                       session_id: str | None = None) -> Generation:
        """Run one request to the end. ``sampling``: SamplingParams fields (ValueError if bad)."""
        tokens, text, last = [], [], None
        async for event in self.stream(prompt, sampling, session_id):
            tokens.extend(event.token_ids)
            text.append(event.text)
            last = event
        return Generation("".join(text), tokens, last.finish_reason.value, last.num_prompt_tokens,
                          last.num_output_tokens, self.replica_id)

    async def stream(self, prompt: str | list[int], sampling: dict | None = None,
                     session_id: str | None = None) -> AsyncIterator[TokenEvent]:
        """Yield the request's TokenEvents; closing the generator aborts the request."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        params = SamplingParams(**(sampling or {}))
        if "max_tokens" not in (sampling or {}):           # the default (16), within what the context leaves
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens, self.max_new_tokens(len(ids))))
        self.check_context(len(ids), params.max_tokens)
        streams = await self.open(f"py-{uuid.uuid4().hex}", [ids], [[params]], session_id)
        async for _, event in self.run(streams, time.perf_counter(), paced=True):   # a Ray message an event
            yield event

    async def export_prefix(self, prompt: str | list[int]) -> list[tuple[bytes, bytes]]:
        """This replica's cached prefix of ``prompt`` (its longest snapshotted one) as msgpack
        records (``Engine.export_prefix``) for another replica's ``import_prefix``: what moves a
        session's cached prefix when the session moves; [] when none is cached here."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return await self.loop.call(operator.methodcaller("export_prefix", ids))

    async def import_prefix(self, records: list[tuple[bytes, bytes]]) -> int:
        """Another replica's ``export_prefix`` records into this one's prefix cache (its host
        tier: the next request with that prompt starts from them); the prompt tokens covered.
        ValueError if they come from another model."""
        return await self.loop.call(operator.methodcaller("import_prefix", records))

    async def engine_status(self) -> dict:
        """Pools, ledger and integrity, checked on the engine's owner thread between steps; the node
        the replica runs on."""
        return {"replica_id": self.replica_id, "node_id": ray.get_runtime_context().get_node_id(),
                **await self.loop.status()}

    # ------------------------------------------------------------------ Serve hooks
    def record_routing_stats(self) -> dict:
        s = self.loop.snapshot
        return {"num_running": s.num_running, "num_pending": s.num_pending,
                "num_free_blocks": s.num_free_blocks, "num_free_rows": s.num_free_rows,
                "kv_usage": 1 - s.num_free_blocks / max(s.num_usable_blocks, 1),
                "num_sessions": len(s.sessions), "drained": s.num_blocks_granted == 0}

    def check_health(self) -> None:
        if self.loop.failed is not None:
            raise RuntimeError(f"engine failed: {self.loop.failed!r}")
        why = self.api_servers.failed() if self.api_servers is not None else None
        if why is not None:
            raise RuntimeError(why)
        if self._stopping.is_set():
            raise RuntimeError("the replica has shut down")

    async def metrics_text(self) -> bytes:
        """Prometheus text for every replica the planner knows, this one fresh."""
        replicas, routing, handover = {}, {}, None
        if self._planner is None and self.app_name:
            self._planner = get_planner(self.app_name)
        planner = self._planner
        if planner is not None:
            try:
                replicas, routing, handover = await asyncio.gather(
                    planner.metrics.remote(), planner.routing_counts.remote(), planner.handover_counts.remote())
            except Exception as e:
                logger.warning(f"planner metrics unavailable: {e!r}")
                self._planner = None
        replicas[self.replica_id] = (self.metrics_snapshot(), self.loop.snapshot)
        return render_metrics(self.model_name, replicas, routing, handover)

    def metrics_snapshot(self) -> MetricsSnapshot:
        """This replica's request metrics: its own, and its API servers' (as of their last report)."""
        peers = getattr(self.loop, "peer_metrics", None)
        return merge_metrics([self.recorder.snapshot(), *peers.values()]) if peers else self.recorder.snapshot()

    # ------------------------------------------------------------------ planner reports
    def _report_loop(self, reported: threading.Event) -> None:
        """Report at once, then every ``report_interval_s`` until the replica stops, applying each
        plan; ``reported`` is set when the planner has answered for the first time."""
        planner = None
        granted = None
        while not self._stopping.is_set():
            try:
                if planner is None:
                    planner = self._planner = get_or_create_planner(
                        self.app_name, draft_cost=self.config.engine.spec.draft_cost,
                        handover_max_bytes=int(self.config.session_handover_gib * 2**30))
                snapshot = self.loop.snapshot
                report = WorkerReport(self.replica_id, self.incarnation, snapshot, self.metrics_snapshot(),
                                      self.max_drafts, adaptive=self.policy is not None, actor_name=self._actor_name,
                                      handover_version=self._handover_version,
                                      http_url=self.api_servers.url if self.api_servers is not None else None)
                if self.api_servers is not None:          # the API servers count this replica's traffic too
                    self.loop.send_metrics(self.recorder.snapshot())
                plan = ray.get(planner.report.remote(report), timeout=10)
            except Exception as e:
                logger.warning(f"report to the planner failed ({e!r}); retrying")
                planner = self._planner = None
            else:
                if plan.handover_sessions is not None:
                    self._handed_over, self._handover_version = plan.handover_sessions, plan.handover_version
                if (plan.num_blocks_granted, plan.num_rows_granted) != granted:
                    granted = (plan.num_blocks_granted, plan.num_rows_granted)
                    self.loop.set_grant(*granted)
                if self.policy is not None:
                    self.policy.set_plan(plan.num_drafts, plan.prior_acceptance)
                reported.set()
            self._stopping.wait(self.config.report_interval_s)

    # ------------------------------------------------------------------ session hand-over
    async def take_handover(self, session_id: str) -> int:
        """Import the cached prefix a stopped replica handed over for ``session_id`` (one planner
        call, which removes it there); the prompt tokens it covers. Never raises: a failure is
        logged and the request recomputes its prefix."""
        self._handed_over = self._handed_over - {session_id}     # one request of the session asks
        try:
            planner = self._planner or get_planner(self.app_name)
            records = await asyncio.wait_for(planner.take_handover.remote(session_id), TAKE_TIMEOUT_S) \
                if planner is not None else None
            if not records:
                return 0
            num_tokens = await self.loop.call(operator.methodcaller("import_prefix", records))
            logger.info(f"session {session_id}: imported its handed-over prefix ({num_tokens} tokens, "
                        f"{records_size(records) / 2**20:.1f} MiB)")
            return num_tokens
        except Exception as e:  # noqa: BLE001 - a cache: the request goes on without it
            logger.warning(f"session {session_id}: its handed-over prefix was not imported ({e!r})")
            return 0

    def hand_over_sessions(self) -> dict:
        """Export each session's cached prefix (``EngineLoop.export_sessions``: most recently used
        first, at most ``session_handover_gib``) and push the records to the planner by value, in
        calls of at most HANDOVER_CALL_BYTES, each waited for (the planner holds its own copy
        before this replica exits). Half of ``session_handover_timeout_s`` goes to the export, the
        whole of it bounds everything: it runs on a thread of its own with an event loop of its
        own, joined with that deadline, so a stop never hangs here. Errors are logged, never
        raised. Returns {"sessions", "bytes", "seconds"} handed over."""
        timeout_s = self.config.session_handover_timeout_s
        done = {"sessions": 0, "bytes": 0, "seconds": 0.0}
        started = time.monotonic()

        async def hand_over():
            sessions = await self.loop.export_sessions(int(self.config.session_handover_gib * 2**30), timeout_s / 2)
            planner = (self._planner or get_planner(self.app_name)) if sessions else None
            if planner is None:
                return
            for batch in _batches(sessions, HANDOVER_CALL_BYTES):
                await planner.hand_over.remote(self.replica_id, dict(batch))
                done["sessions"] += len(batch)
                done["bytes"] += sum(records_size(records) for _, records in batch)

        def run():
            try:
                asyncio.run(asyncio.wait_for(hand_over(), timeout_s))
            except Exception as e:  # noqa: BLE001 - a cache: losing it costs recompute, never a stop
                done["error"] = e
        thread = threading.Thread(target=run, name="mtpserve-handover", daemon=True)
        thread.start()
        thread.join(timeout_s + 1.0)
        done["seconds"] = time.monotonic() - started
        summary = f"handed over {done['sessions']} sessions, {done['bytes'] / 2**20:.1f} MiB in {done['seconds']:.2f} s"
        if "error" in done or thread.is_alive():
            logger.warning(f"{summary}; the rest was not ({done.get('error', 'still running')!r})")
        else:
            logger.info(summary)
        return {k: done[k] for k in ("sessions", "bytes", "seconds")}

    def shutdown(self) -> None:
        """Stop: the reports end, the sessions are handed over (in Serve, unless
        ``session_handover_gib`` is 0 or the engine failed), the engine stops. Serve calls this
        through ``__del__`` when it stops the replica gracefully (scale-down, redeploy, deletion,
        a replacement), after its drain; a crashed or killed replica hands nothing over."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._reporter is not None:
            self._reporter.join(1.0)        # a report sent after the hand-over would bind its sessions here again
        if self.app_name is not None and self.config.session_handover_gib > 0 and self.loop.failed is None:
            self.hand_over_sessions()       # (a failed engine's cache is not to be trusted)
        if self.api_servers is not None:
            self.api_servers.stop()
        self.loop.stop()

    def __del__(self):
        stopping = getattr(self, "_stopping", None)
        if stopping is not None and not stopping.is_set():
            self.shutdown()


def _batches(sessions: list[tuple[str, Records]], max_bytes: int) -> list[list[tuple[str, Records]]]:
    """Consecutive runs of ``sessions`` of at most ``max_bytes`` of records each (a larger one alone)."""
    batches, size = [], 0
    for item in sessions:
        n = records_size(item[1])
        if not batches or size + n > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += n
    return batches


@serve.deployment(
    max_ongoing_requests=1024,
    health_check_period_s=5,
    ray_actor_options={"num_cpus": 1},
    request_router_config=router_config())
@serve.ingress(api)
class LLMServer(OpenAIRoutes, Worker):
    """The deployment: one engine per replica, OpenAI routes on the replica itself."""
