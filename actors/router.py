"""State-affinity request routing: a Ray Serve ``RequestRouter`` for the worker deployment.

For each request, in order of preference:

1. its session (``x-session-id`` header, or ``handle.options(session_id=...)``) goes to the
   replica that holds it: the planner's session table, or this router's own recent binding;
2. otherwise the least-loaded replica, by the planner's placement view (running + waiting
   requests, KV usage; drained replicas last), never older than this router's own count of
   requests in flight (so a burst spreads before the next view arrives).

The view is pulled from the planner actor in the background every ``refresh_interval_s``; the
routing decision itself makes no remote call. A new session is bound to the chosen replica
locally at once and told to the planner without waiting. Ranks are returned one replica each,
so Serve tries them in this order and only moves on when a replica is at its queue limit.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import defaultdict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mtpserve.actors.planner import PlacementView, ReplicaLoad, get_planner

logger = logging.getLogger("ray.serve")

DRAINED_PENALTY = 1e6
MAX_LOCAL_SESSIONS = 100_000


def replica_load(view: ReplicaLoad | None, routing_stats: dict, num_in_flight: int) -> float:
    """Load score of one replica: active requests (+ KV usage as a tie-breaker)."""
    if view is not None:
        active, kv, drained = view.num_running + view.num_pending, view.kv_usage, view.drained
    else:
        active = routing_stats.get("num_running", 0) + routing_stats.get("num_pending", 0)
        kv, drained = routing_stats.get("kv_usage", 0.0), routing_stats.get("drained", False)
    return max(active, num_in_flight) + kv + (DRAINED_PENALTY if drained else 0.0)


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


class StateAffinityRouter(RequestRouter):
    """See the module docstring. kwargs: ``refresh_interval_s`` (default 0.25), ``max_view_age_s`` (2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._refresh_interval_s = 0.25
        self._max_view_age_s = 2.0
        self._view: PlacementView | None = None
        self._view_received_at = 0.0
        self._sessions: dict[str, str] = {}
        self._in_flight: defaultdict[str, int] = defaultdict(int)
        self._refresh_task: asyncio.Task | None = None
        self._planner = None

    def initialize_state(self, refresh_interval_s: float = 0.25, max_view_age_s: float = 2.0, **kwargs):
        self._refresh_interval_s = refresh_interval_s
        self._max_view_age_s = max_view_age_s

    # ------------------------------------------------------------------ routing
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._ensure_refresh_task()
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        view = self._fresh_view()
        loads = {uid: replica_load(view.replicas.get(uid) if view else None, r.routing_stats or {},
                                   self._in_flight[uid]) for uid, r in by_id.items()}
        session_id = pending_request.metadata.session_id if pending_request is not None else ""
        owner = self._session_owner(session_id) if session_id else None
        order = rank_replicas(list(by_id), loads, owner)
        if session_id and owner != order[0]:
            self._bind_session(session_id, order[0])
        return [[by_id[uid]] for uid in order]

    def on_send_request(self, replica_id: ReplicaID):
        super().on_send_request(replica_id)
        self._in_flight[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str):
        uid = replica_id.unique_id
        self._in_flight[uid] = max(0, self._in_flight[uid] - 1)

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
                    view: PlacementView = await self._planner.placement.remote()
                    self._view, self._view_received_at = view, time.monotonic()
                    # the planner's table is authoritative: another router may have won a race
                    self._sessions.update(view.sessions)
            except Exception as e:
                logger.debug(f"placement refresh failed: {e!r}")
                self._planner = None
            await asyncio.sleep(self._refresh_interval_s if self._planner is not None else 2.0)
