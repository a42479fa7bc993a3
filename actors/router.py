"""State-affinity request routing: a Ray Serve ``RequestRouter`` for the worker deployment.

For each request, in order of preference:

1. its session (``x-session-id`` header, or ``handle.options(session_id=...)``) goes to the
   replica that holds it: the planner's session table, or this router's own recent binding (a
   new session is placed by the rules below and bound where it lands);
2. otherwise (prefix-aware routing, on unless ``prefix_routing`` is off) the replica whose
   prefix cache holds the longest prefix of its prompt, unless that replica's load exceeds the
   least-loaded replica's by more than ``prefix_max_imbalance`` (then the longest match among
   those within the bound; see ``prefer_cached``);
3. otherwise (no replica holds any of it) the least-loaded replica, by the planner's placement
   view (running + waiting requests, KV usage; drained replicas last), never older than this
   router's own count of requests in flight (so a burst spreads before the next view arrives).

The view is pulled from the planner actor in the background every ``refresh_interval_s``; the
routing decision itself makes no remote call. A new session is bound to the chosen replica
locally at once and told to the planner without waiting. Ranks are returned one replica each,
so Serve tries them in this order and only moves on when a replica is at its queue limit.

Where a prompt's prefix is cached comes from each replica's routing index (its prefix cache's
digests, in the view, refreshed only when they change) and this router's memory of where it sent
each prefix lately (``prefix_routing.RecentPrefixes``). The prompt is read from a handle call's
first argument (``generate`` / ``stream``) or, over HTTP, from the head the proxy's middleware
put in the ASGI scope (``proxy_middleware.PromptHeadMiddleware``: Serve hands the router the
scope, pickled, not the body); it is hashed with the served model's tokenizer and chat template
(``model_dir``), loaded in the background at the first request.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import random
import threading
import time
import uuid
from collections import Counter, defaultdict, deque

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mtpserve.actors.planner import PlacementView, ReplicaLoad, get_planner
from mtpserve.actors.prefix_routing import (
    DEFAULT_MAX_IMBALANCE,
    SCOPE_KEY,
    PromptDigests,
    RecentPrefixes,
    block_size_of,
    index_set,
    matched_blocks,
)
from mtpserve.actors.sessions import MAX_SESSION_ID_LENGTH

logger = logging.getLogger("ray.serve")

DRAINED_PENALTY = 1e6
MAX_LOCAL_SESSIONS = 100_000
PROMPT_METHODS = ("generate", "stream")   # handle methods whose first argument is the prompt


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def _http_scope(pending_request: PendingRequest | None) -> dict:
    """An HTTP call's ASGI scope ({} for a handle call, or one that cannot be read)."""
    if pending_request is None or not pending_request.metadata.is_http_request or not pending_request.args:
        return {}
    try:
        arg = pending_request.args[0]
        return pickle.loads(arg).asgi_scope if isinstance(arg, bytes) else getattr(arg, "asgi_scope", {})
    except Exception as e:  # noqa: BLE001 - routing falls back to load; never fail a request here
        logger.debug(f"reading a request's scope failed: {e!r}")
        return {}


def _generates(pending_request: PendingRequest | None, scope: dict) -> bool:
    """Whether a routed call asks for tokens: a POST to a generation route, or a handle's
    generate / stream. Other routes (/metrics, /health, /v1/models, /tokenize, ...) and handle
    methods are routed too but are not counted as routed requests."""
    if pending_request is None:
        return False
    if not pending_request.metadata.is_http_request:
        return pending_request.metadata.call_method in PROMPT_METHODS
    return scope.get("method") == "POST" and scope.get("path", "").rstrip("/").endswith(GENERATION_PATHS)


def replica_load(view: ReplicaLoad | None, routing_stats: dict, num_in_flight: int) -> float:
    """Load score of one replica: active requests (+ KV usage as a tie-breaker)."""
    if view is not None:
        active, kv, drained = view.num_running + view.num_pending, view.kv_usage, view.drained
    else:
        active = routing_stats.get("num_running", 0) + routing_stats.get("num_pending", 0)
        kv, drained = routing_stats.get("kv_usage", 0.0), routing_stats.get("drained", False)
    return max(active, num_in_flight) + kv + (DRAINED_PENALTY if drained else 0.0)


class InFlight:
    """This router's count of requests in flight per replica, with the ones chosen but not yet
    sent counted at once.

    Serve runs several routing tasks at a time: a burst's requests are all chosen before the
    first of them is sent (``on_send_request``), and with only the sent ones counted they all
    saw the same loads and landed at random (8 distinct prompts over 2 replicas: 7 on one now
    and then). A choice counts as in flight from ``chosen`` until that replica's next
    ``sent`` takes it over, or ``tentative_s`` passes (Serve sent it elsewhere: the first
    choice was full)."""

    def __init__(self, tentative_s: float = 1.0):
        self.tentative_s = tentative_s
        self._sent: defaultdict[str, int] = defaultdict(int)
        self._chosen: defaultdict[str, deque[float]] = defaultdict(deque)

    def count(self, replica: str, now: float) -> int:
        chosen = self._chosen.get(replica)
        if chosen:
            while chosen and now - chosen[0] > self.tentative_s:
                chosen.popleft()
        return self._sent.get(replica, 0) + (len(chosen) if chosen else 0)

    def chosen(self, replica: str, now: float) -> None:
        self._chosen[replica].append(now)

    def sent(self, replica: str) -> None:
        chosen = self._chosen.get(replica)
        if chosen:
            chosen.popleft()
        self._sent[replica] += 1

    def completed(self, replica: str) -> None:
        self._sent[replica] = max(0, self._sent[replica] - 1)


def rank_replicas(candidates: list[str], loads: dict[str, float], session_owner: str | None,
                  rng: random.Random = random) -> list[str]:
    """Candidates in order of preference: the session's owner, then least loaded (ties random)."""
    shuffled = list(candidates)
    rng.shuffle(shuffled)
    ordered = sorted(shuffled, key=lambda r: loads.get(r, 0.0))
    if session_owner in candidates:
        ordered.remove(session_owner)
        ordered.insert(0, session_owner)
    return ordered


def prefer_cached(order: list[str], loads: dict[str, float], matched: dict[str, int],
                  max_imbalance: float) -> tuple[list[str], str]:
    """The prefix-aware rule, applied to ``rank_replicas``'s least-loaded order (no session owner).

    ``matched``: leading prompt blocks each replica holds. Among replicas with a match whose load
    is at most ``max_imbalance`` above the least loaded one's, the longest match goes first (ties:
    the less loaded); the rest keep their order. Returns (order, decision): ``hit`` (a match
    went first), ``overloaded`` (every match is beyond the bound: least-loaded order) or ``miss``
    (no replica holds any of the prompt: least-loaded order)."""
    if not any(matched.get(r, 0) > 0 for r in order):
        return order, "miss"
    least = loads.get(order[0], 0.0)
    within = [r for r in order if matched.get(r, 0) > 0 and loads.get(r, 0.0) - least <= max_imbalance]
    if not within:
        return order, "overloaded"
    best = max(within, key=lambda r: matched[r])       # the first of the longest: the least loaded of them
    return [best] + [r for r in order if r != best], "hit"


def route(candidates: list[str], loads: dict[str, float], session_owner: str | None, matched: dict[str, int],
          max_imbalance: float, rng: random.Random = random) -> tuple[list[str], str]:
    """The whole rule: a live session owner first (decision ``session``), else ``prefer_cached``
    over the least-loaded order (``prefix_hit`` / ``prefix_overloaded`` / ``prefix_miss``)."""
    order = rank_replicas(candidates, loads, session_owner, rng)
    if session_owner in candidates:
        return order, "session"
    order, decision = prefer_cached(order, loads, matched, max_imbalance)
    return order, f"prefix_{decision}"


class StateAffinityRouter(RequestRouter):
    """See the module docstring. kwargs (``RequestRouterConfig.request_router_kwargs``):
    ``refresh_interval_s`` (default 0.25), ``max_view_age_s`` (2), ``model_dir`` (the served
    export: prefix-aware routing needs its tokenizer; without it, none), ``prefix_routing``
    (True), ``prefix_max_imbalance`` (DEFAULT_MAX_IMBALANCE requests)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._refresh_interval_s = 0.25
        self._max_view_age_s = 2.0
        self._view: PlacementView | None = None
        self._view_received_at = 0.0
        self._sessions: dict[str, str] = {}
        self._in_flight = InFlight()
        self._refresh_task: asyncio.Task | None = None
        self._planner = None
        self._model_dir: str | None = None
        self._kv_block_size: int | None = None
        self._prefix_routing = False
        self._max_imbalance = DEFAULT_MAX_IMBALANCE
        self._digests: PromptDigests | None = None      # set by the loader thread
        self._loader: threading.Thread | None = None
        self._indexes: dict[str, tuple[int, frozenset[bytes]]] = {}   # replica -> (version, index)
        self._recent = RecentPrefixes()
        self.counts: Counter[str] = Counter()            # routing decisions, by kind (see _decide)
        self._router_id = uuid.uuid4().hex

    def initialize_state(self, refresh_interval_s: float = 0.25, max_view_age_s: float = 2.0,
                         model_dir: str | None = None, prefix_routing: bool = True,
                         prefix_max_imbalance: float = DEFAULT_MAX_IMBALANCE, kv_block_size: int | None = None,
                         **kwargs):
        """kv_block_size: the replicas' KV block size when it is not the export's (the engine's
        ``kv_block_size``): the routing digests are of blocks of that size, as the replicas' caches'."""
        self._refresh_interval_s = refresh_interval_s
        self._max_view_age_s = max_view_age_s
        self._model_dir = model_dir
        self._kv_block_size = kv_block_size
        self._prefix_routing = bool(prefix_routing and model_dir)
        self._max_imbalance = float(prefix_max_imbalance)
        if self._prefix_routing:
            self._start_loading()

    # ------------------------------------------------------------------ routing
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._ensure_refresh_task()
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        view = self._fresh_view()
        now = time.monotonic()
        loads = {uid: replica_load(view.replicas.get(uid) if view else None, r.routing_stats or {},
                                   self._in_flight.count(uid, now)) for uid, r in by_id.items()}
        session_id = pending_request.metadata.session_id if pending_request is not None else ""
        if len(session_id or "") > MAX_SESSION_ID_LENGTH:   # the replica refuses it: bind nothing
            session_id = ""
        owner = self._session_owner(session_id) if session_id else None
        scope = _http_scope(pending_request)
        digests = [] if owner in by_id or not self._prefix_routing else self._prompt_digests(pending_request, scope)
        matched = {}
        if digests:
            indexes = {uid: self._indexes[uid][1] for uid in by_id if uid in self._indexes}
            matched = matched_blocks(digests, indexes, self._recent, now)
        order, decision = route(list(by_id), loads, owner, matched, self._max_imbalance)
        if _generates(pending_request, scope):     # not /metrics, /health, /v1/models, ... (a scrape is no request)
            self.counts[decision if decision == "session" or digests else "no_prefix"] += 1
        if digests:
            self._recent.remember(digests, order[0], now)
        if session_id and owner != order[0]:
            self._bind_session(session_id, order[0])
        self._in_flight.chosen(order[0], now)
        return [[by_id[uid]] for uid in order]

    # ------------------------------------------------------------------ prefixes
    def _prompt_digests(self, pending_request: PendingRequest | None, scope: dict) -> list[bytes]:
        """The routing digests of the request's prompt (``scope``: an HTTP call's, read once);
        [] if unknown (not loaded yet, no prompt)."""
        if pending_request is None or not pending_request.args:
            return []
        if self._digests is None:
            self._start_loading()
            return []
        try:
            if pending_request.metadata.is_http_request:
                head = scope.get(SCOPE_KEY)
                return self._digests.of_head(head) if head else []
            if pending_request.metadata.call_method in PROMPT_METHODS:
                prompt = pending_request.args[0]
                if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
                    return self._digests.of_prompt(prompt)
        except Exception as e:  # noqa: BLE001 - routing falls back to load; never fail a request here
            logger.debug(f"prompt digests failed: {e!r}")
        return []

    def _start_loading(self) -> None:
        """Load the model's tokenizer on a thread (a large vocabulary takes a second)."""
        if self._loader is not None:
            return

        def load():
            try:
                from mtpserve.engine.bundled import resolve_model_dir
                from mtpserve.engine.tokenizer import Tokenizer
                path = resolve_model_dir(self._model_dir)
                self._digests = PromptDigests(Tokenizer(path), self._kv_block_size or block_size_of(path))
            except Exception as e:  # noqa: BLE001 - without it, routing is by load alone
                logger.warning(f"prefix-aware routing is off: the tokenizer of {self._model_dir} did not load ({e!r})")
                self._prefix_routing = False
        self._loader = threading.Thread(target=load, name="mtpserve-router-tokenizer", daemon=True)
        self._loader.start()

    def on_send_request(self, replica_id: ReplicaID):
        super().on_send_request(replica_id)
        self._in_flight.sent(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str):
        self._in_flight.completed(replica_id.unique_id)

    # ------------------------------------------------------------------ sessions
    def _session_owner(self, session_id: str) -> str | None:
        owner = self._sessions.get(session_id)
        if owner is None and self._view is not None:
            owner = self._view.sessions.get(session_id)
        return owner

    def _bind_session(self, session_id: str, replica_id: str) -> None:
        self._sessions[session_id] = replica_id
        if len(self._sessions) > MAX_LOCAL_SESSIONS:
            self._sessions.pop(next(iter(self._sessions)))
        if self._planner is not None:
            try:
                self._planner.bind_session.remote(session_id, replica_id)
            except Exception:  # the planner is restarting; the next refresh finds it again
                self._planner = None

    # ------------------------------------------------------------------ planner view
    def _fresh_view(self) -> PlacementView | None:
        if self._view is None or time.monotonic() - self._view_received_at > self._max_view_age_s:
            return None
        return self._view

    def _take_indexes(self, view: PlacementView) -> None:
        """Keep the routing indexes the view brought (only changed ones), for live replicas."""
        for rid, (version, index) in view.prefix_indexes.items():   # (off: versions only, not re-sent)
            self._indexes[rid] = (version, index_set(index) if self._prefix_routing else frozenset())
        for rid in set(self._indexes) - set(view.replicas):
            del self._indexes[rid]

    def _ensure_refresh_task(self) -> None:
        if self._refresh_task is None or self._refresh_task.done():
            self._refresh_task = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        app_name = self._deployment_id.app_name
        while True:
            try:
                if self._planner is None:
                    self._planner = get_planner(app_name)
                if self._planner is not None:
                    known = {rid: version for rid, (version, _) in self._indexes.items()}
                    view: PlacementView = await self._planner.placement.remote(known, self._router_id,
                                                                               dict(self.counts))
                    self._view, self._view_received_at = view, time.monotonic()
                    # the planner's table is authoritative: another router may have won a race
                    self._sessions.update(view.sessions)
                    self._take_indexes(view)
            except Exception as e:
                logger.debug(f"placement refresh failed: {e!r}")
                self._planner = None
            await asyncio.sleep(self._refresh_interval_s if self._planner is not None else 2.0)
