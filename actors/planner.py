"""The planner actor: cluster-wide admission grants, placement view, sessions and draft counts.

One named, detached Ray actor per Serve application. It is never on the per-step path and not on
the per-request path either: workers report to it every ``report_interval_s`` and get their
plan back in the reply; routers pull its placement view a few times a second.

    worker --WorkerReport (full snapshot)--> planner --WorkerPlan--> worker (grant, K per request)
    router --placement(known, counts)---->  planner --PlacementView--> router (loads, sessions,
                                                       prefix indexes that changed since `known`)
    router --bind_session(sid, replica)-->  planner   (fire and forget)
    stopping worker --hand_over(replica, {sid: records})--> planner   (HandoverStore; ids in WorkerPlans)
    worker --take_handover(sid)---------->  planner --records--> worker  (a listed session's first request)

Reports are full snapshots, never deltas, so the planner's view is rebuilt from scratch by the
next round of reports: after a worker restart (the new replica reports under a new id, the old
one stops and is forgotten, its sessions are re-placed) and after the planner itself is
restarted (workers report the sessions they hold). A replica whose reports stop is forgotten
after ``replica_ttl_s`` (a loaded replica may just be late), or as soon as its Ray actor is
gone: the actor looks up every replica silent for ``SILENT_AFTER_S``, so a killed replica
leaves the view within a second or two.

The actor runs on the head node (Ray's ``node:__internal_head__`` resource), whichever replica
creates it: the head lives as long as the cluster does, so a worker node's loss (with the
replicas on it) never takes the planner along; its view sheds the lost replicas as above.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import ray

from mtpserve.actors.engine_loop import LoopSnapshot
from mtpserve.actors.handover import DEFAULT_HANDOVER_GIB, HandoverCounts, HandoverStore, Records
from mtpserve.actors.metrics import MetricsSnapshot
from mtpserve.engine.acceptance import PRIOR_ACCEPTANCE
from mtpserve.engine.draft_policy import DEFAULT_DRAFT_COST, DraftCostModel, choose_num_drafts

NAMESPACE = "mtpserve"
HEAD_NODE_RESOURCE = "node:__internal_head__"    # Ray gives the head node 1 of it
SILENT_AFTER_S = 1.0             # a replica this long without a report is checked for liveness
ROUTER_TTL_S = 86_400.0          # a router silent this long is forgotten (its decision counts too)


def planner_name(app_name: str) -> str:
    return f"mtpserve-planner-{app_name}"


@dataclass
class WorkerReport:
    """A replica's full state as its owner thread last published it."""
    replica_id: str
    incarnation: str                 # new on every worker start
    loop: LoopSnapshot
    metrics: MetricsSnapshot
    max_drafts: int                  # the replica's cap on drafts per step (0 = MTP off)
    adaptive: bool                   # whether the replica follows planned draft counts
    actor_name: str | None = None    # the replica's named Ray actor, for liveness checks
    handover_version: tuple | None = None   # the version of the handed-over session ids it holds
    http_url: str | None = None      # where its own API servers serve (``api_servers``), if they do


@dataclass
class WorkerPlan:
    """The planner's answer to a report."""
    num_blocks_granted: int
    num_rows_granted: int
    num_drafts: dict[str, int] = field(default_factory=dict)   # request id -> K
    # for requests not planned yet: the cluster's measured acceptance, None until a replica reported trials
    prior_acceptance: float | None = None
    # the sessions whose cached prefixes a stopped replica handed over (``handover``), sent only
    # when they changed since the report's handover_version (None: unchanged); and their version
    handover_sessions: frozenset[str] | None = None
    handover_version: tuple | None = None


@dataclass
class ReplicaLoad:
    """What a router needs to rank a replica."""
    num_running: int
    num_pending: int
    kv_usage: float
    headroom_blocks: int             # grant - worst-case reservations
    drained: bool


@dataclass
class PlacementView:
    replicas: dict[str, ReplicaLoad]
    sessions: dict[str, str]         # session id -> replica id
    taken_at: float
    # replica id -> (version, its prefix cache's routing index: 8-byte digests, newest first), for
    # the replicas whose index changed since the versions the router said it holds
    prefix_indexes: dict[str, tuple[int, bytes]] = field(default_factory=dict)


class PlannerState:
    """The planner's logic without Ray (the actor below wraps it)."""

    def __init__(self, cost: DraftCostModel = DraftCostModel(), replica_ttl_s: float = 15.0,
                 session_ttl_s: float = 600.0, prior_acceptance: float = PRIOR_ACCEPTANCE,
                 max_sessions: int = 100_000, handover_max_bytes: int = int(DEFAULT_HANDOVER_GIB * 2**30)):
        """max_sessions: the session table's bound (least recently seen dropped first): a client
        inventing session ids cannot grow the planner without limit. handover_max_bytes: the most
        handed-over records held (``HandoverStore``; they expire after ``session_ttl_s`` too)."""
        self.cost = cost
        self.replica_ttl_s = replica_ttl_s
        self.session_ttl_s = session_ttl_s
        self.max_sessions = max_sessions
        self.prior_acceptance = prior_acceptance
        self.num_prior_trials = 0          # draft trials behind prior_acceptance (0: still the guess)
        self.reports: dict[str, tuple[WorkerReport, float]] = {}   # replica -> (report, received)
        self.sessions: dict[str, tuple[str, float]] = {}           # session -> (replica, last seen)
        self.drained: set[str] = set()
        self.plans: dict[str, dict[str, tuple[float, int]]] = {}   # replica -> rid -> (alpha, K)
        self.routing: dict[str, tuple[dict[str, int], float]] = {}  # router -> (decision counts, seen)
        self.handovers = HandoverStore(handover_max_bytes, session_ttl_s)

    def report(self, report: WorkerReport, now: float) -> WorkerPlan:
        rid = report.replica_id
        previous = self.reports.get(rid)
        if previous is not None and previous[0].incarnation != report.incarnation:
            self._forget_replica(rid)                      # same id, fresh process: start over
        self.reports[rid] = (report, now)
        for session in report.loop.sessions:
            self.sessions[session] = (rid, now)
        self._update_prior(report)
        self.expire(now)
        loop = report.loop
        plan = WorkerPlan(0 if rid in self.drained else loop.num_usable_blocks,
                          0 if rid in self.drained else loop.num_rows,
                          prior_acceptance=self.prior_acceptance if self.num_prior_trials else None,
                          handover_version=self.handovers.version)
        if report.handover_version != self.handovers.version:
            plan.handover_sessions = self.handovers.session_ids()
        planned = {}
        if report.adaptive and report.max_drafts > 0:
            cost = self.cost if loop.draft_cost is None else DraftCostModel(loop.draft_cost, scale_with_load=False)
            for request_id, (alpha, _) in loop.acceptance.items():
                k = choose_num_drafts(alpha, loop.load, report.max_drafts, cost)
                plan.num_drafts[request_id] = k
                planned[request_id] = (alpha, k)
        self.plans[rid] = planned
        return plan

    def _update_prior(self, report: WorkerReport) -> None:
        """Cluster-wide acceptance: a trial-weighted mean over reported requests, smoothed."""
        trials = sum(n for _, n in report.loop.acceptance.values())
        self.num_prior_trials += trials
        if trials:
            mean = sum(a * n for a, n in report.loop.acceptance.values()) / trials
            self.prior_acceptance += 0.2 * (mean - self.prior_acceptance)

    def bind_session(self, session_id: str, replica_id: str, now: float) -> str:
        """Place a session on a replica unless it already lives on a live one; the owner."""
        owner = self.sessions.get(session_id)
        if owner is not None and owner[0] in self.reports and owner[0] != replica_id:
            self.sessions[session_id] = (owner[0], now)
            return owner[0]
        self.sessions[session_id] = (replica_id, now)
        if len(self.sessions) > self.max_sessions * 1.1:      # amortised: trim in batches
            self._bound_sessions()
        return replica_id

    def hand_over(self, replica_id: str, sessions: dict[str, Records], now: float) -> int:
        """A stopping replica's sessions' cached prefixes (``HandoverStore.put``); each of them is
        unbound from it, so its next request is placed afresh. Returns how many were kept."""
        kept = 0
        for session_id, records in sessions.items():
            kept += self.handovers.put(session_id, records, now)
            owner = self.sessions.get(session_id)
            if owner is not None and owner[0] == replica_id:
                del self.sessions[session_id]
        return kept

    def take_handover(self, session_id: str) -> Records | None:
        """The records handed over for a session, removed (None if none are held)."""
        return self.handovers.take(session_id)

    def drain(self, replica_id: str, drained: bool = True) -> None:
        """A drained replica gets a zero grant: running requests finish, new ones go elsewhere."""
        (self.drained.add if drained else self.drained.discard)(replica_id)

    def expire(self, now: float) -> None:
        for rid, (_, received) in list(self.reports.items()):
            if now - received > self.replica_ttl_s:
                self._forget_replica(rid)
        for sid, (rid, seen) in list(self.sessions.items()):
            if now - seen > self.session_ttl_s or rid not in self.reports:
                del self.sessions[sid]
        self._bound_sessions()
        self.handovers.expire(now)

    def _bound_sessions(self) -> None:
        if len(self.sessions) > self.max_sessions:
            keep = sorted(self.sessions.items(), key=lambda item: item[1][1])[-self.max_sessions:]
            self.sessions = dict(keep)

    def silent_replicas(self, now: float, after_s: float) -> list[WorkerReport]:
        """The latest reports of replicas that have not reported for ``after_s``."""
        return [r for r, received in self.reports.values() if now - received > after_s]

    def forget(self, replica_id: str) -> None:
        """Drop a replica known to be gone (its sessions are placed afresh)."""
        self._forget_replica(replica_id)

    def _forget_replica(self, replica_id: str) -> None:
        self.reports.pop(replica_id, None)
        self.plans.pop(replica_id, None)
        for sid, (rid, _) in list(self.sessions.items()):
            if rid == replica_id:
                del self.sessions[sid]

    def placement(self, now: float, known: dict[str, int] | None = None) -> PlacementView:
        """Loads and sessions; the prefix index of each replica whose version is not ``known[replica]``
        (None: every replica's)."""
        self.expire(now)
        known = known or {}
        replicas, indexes = {}, {}
        for rid, (r, _) in self.reports.items():
            if known.get(rid) != r.loop.prefix_index_version:
                indexes[rid] = (r.loop.prefix_index_version, r.loop.prefix_index)
            s = r.loop
            replicas[rid] = ReplicaLoad(
                num_running=s.num_running, num_pending=s.num_pending,
                kv_usage=1 - s.num_free_blocks / max(s.num_usable_blocks, 1),
                headroom_blocks=(0 if rid in self.drained else s.num_blocks_granted) - s.num_reserved_blocks,
                drained=rid in self.drained)
        return PlacementView(replicas, {sid: rid for sid, (rid, _) in self.sessions.items()}, now, indexes)

    def note_routing(self, router_id: str, counts: dict[str, int], now: float) -> None:
        """A router's decision counts so far (``StateAffinityRouter.counts``: totals, not deltas);
        routers silent for ROUTER_TTL_S are forgotten (a proxy restarted, its router with it)."""
        self.routing[router_id] = (dict(counts), now)
        for rid, (_, seen) in list(self.routing.items()):
            if now - seen > ROUTER_TTL_S:
                del self.routing[rid]

    def routing_counts(self) -> dict[str, int]:
        """Every router's decisions, summed by reason."""
        total: dict[str, int] = {}
        for counts, _ in self.routing.values():
            for reason, n in counts.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def handover_counts(self) -> HandoverCounts:
        return self.handovers.counts()

    def http_urls(self) -> dict[str, str]:
        """{replica id: base URL} of the replicas whose own API servers serve a direct URL."""
        return {rid: r.http_url for rid, (r, _) in self.reports.items() if r.http_url}

    def metrics(self) -> dict[str, tuple[MetricsSnapshot, LoopSnapshot]]:
        """Every replica's figures for /metrics (its routing index left out: routers' business)."""
        return {rid: (r.metrics, dataclasses.replace(r.loop, prefix_index=b""))
                for rid, (r, _) in self.reports.items()}


@ray.remote(num_cpus=0, max_restarts=-1)
class PlannerActor:
    """The Ray face of ``PlannerState``; every method is a few dict operations."""

    def __init__(self, replica_ttl_s: float = 15.0, draft_cost: float = DEFAULT_DRAFT_COST,
                 handover_max_bytes: int = int(DEFAULT_HANDOVER_GIB * 2**30)):
        self.state = PlannerState(DraftCostModel(draft_cost), replica_ttl_s=replica_ttl_s,
                                  handover_max_bytes=handover_max_bytes)
        self._checked_at = 0.0

    def report(self, report: WorkerReport) -> WorkerPlan:
        return self.state.report(report, time.time())

    def bind_session(self, session_id: str, replica_id: str) -> str:
        return self.state.bind_session(session_id, replica_id, time.time())

    def placement(self, known: dict[str, int] | None = None, router_id: str | None = None,
                  counts: dict[str, int] | None = None) -> PlacementView:
        """The view for routers (``PlannerState.placement``); a router also hands in its decision counts."""
        now = time.time()
        if router_id is not None and counts is not None:
            self.state.note_routing(router_id, counts, now)
        if now - self._checked_at > SILENT_AFTER_S:
            self._checked_at = now
            silent = [r for r in self.state.silent_replicas(now, SILENT_AFTER_S) if r.actor_name]
            live = _live_actor_names() if silent else set()
            for report in silent:
                if report.actor_name not in live:
                    self.state.forget(report.replica_id)
        return self.state.placement(now, known)

    def metrics(self) -> dict:
        return self.state.metrics()

    def routing_counts(self) -> dict[str, int]:
        return self.state.routing_counts()

    def http_urls(self) -> dict[str, str]:
        return self.state.http_urls()

    def hand_over(self, replica_id: str, sessions: dict[str, Records]) -> int:
        """A stopping replica's sessions' records, sent by value (bytes in the call: objects the
        replica put in the object store would die with it); ``PlannerState.hand_over``."""
        return self.state.hand_over(replica_id, sessions, time.time())

    def take_handover(self, session_id: str) -> Records | None:
        return self.state.take_handover(session_id)

    def handover_counts(self) -> HandoverCounts:
        return self.state.handover_counts()

    def drain(self, replica_id: str, drained: bool = True) -> None:
        self.state.drain(replica_id, drained)

    def draft_plans(self) -> dict[str, dict[str, tuple[float, int]]]:
        """{replica: {request id: (acceptance EMA, planned K)}} from the latest reports."""
        return self.state.plans

    def where(self) -> dict:
        """This actor's node and process (a restarted planner has a new pid and an empty view)."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "actor_id": ctx.get_actor_id()}


def _live_actor_names() -> set[str]:
    """Names of the cluster's live named actors, every namespace (a dead actor's name is released)."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def get_or_create_planner(app_name: str, replica_ttl_s: float = 15.0, draft_cost: float = DEFAULT_DRAFT_COST,
                          handover_max_bytes: int = int(DEFAULT_HANDOVER_GIB * 2**30)):
    """The application's planner actor, created (detached, restartable, on the head node) by the
    first caller (whose arguments it keeps)."""
    return PlannerActor.options(name=planner_name(app_name), namespace=NAMESPACE, lifetime="detached",
                                get_if_exists=True, resources={HEAD_NODE_RESOURCE: 0.001}
                                ).remote(replica_ttl_s, draft_cost, handover_max_bytes)


def get_planner(app_name: str):
    """The planner actor if it exists, else None."""
    try:
        return ray.get_actor(planner_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return None


def shutdown_planner(app_name: str) -> bool:
    """Kill the application's planner (it is detached: deleting the app leaves it running)."""
    handle = get_planner(app_name)
    if handle is None:
        return False
    ray.kill(handle, no_restart=True)
    return True
