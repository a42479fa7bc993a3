"""The planner's logic without Ray: draft plans, grants, placement, sessions, rebuilding its view."""
from mtpserve.actors.engine_loop import LoopSnapshot
from mtpserve.actors.metrics import MetricsSnapshot
from mtpserve.actors.planner import PlannerState, WorkerReport


def report(replica="r1", incarnation="i1", acceptance=None, sessions=(), running=0, pending=0,
           reserved_blocks=0, reserved_rows=0, granted=(100, 8), max_drafts=4, adaptive=True, draft_cost=None,
           prefix_index=b"", prefix_index_version=0):
    loop = LoopSnapshot(num_usable_blocks=100, num_free_blocks=100 - reserved_blocks, num_rows=8,
                        num_free_rows=8 - reserved_rows, num_blocks_granted=granted[0],
                        num_rows_granted=granted[1], num_reserved_blocks=reserved_blocks,
                        num_reserved_rows=reserved_rows, num_running=running, num_pending=pending,
                        sessions=tuple(sessions), acceptance=dict(acceptance or {}), draft_cost=draft_cost,
                        prefix_index=prefix_index, prefix_index_version=prefix_index_version)
    return WorkerReport(replica, incarnation, loop, MetricsSnapshot(), max_drafts, adaptive)


def test_plans_lower_k_for_rejected_drafts_and_raise_it_for_accepted_ones():
    planner = PlannerState()
    plan = planner.report(report(acceptance={"good": (0.9, 40), "bad": (0.05, 40)}), now=0.0)
    assert plan.num_drafts["good"] == 4 and plan.num_drafts["bad"] == 0
    # the same request, later: its drafts started being rejected, then accepted again
    k_mid = planner.report(report(acceptance={"good": (0.3, 80)}), now=0.1).num_drafts["good"]
    k_end = planner.report(report(acceptance={"good": (0.85, 120)}), now=0.2).num_drafts["good"]
    assert k_mid < 4 and k_end > k_mid
    assert planner.plans["r1"]["good"] == (0.85, k_end)


def test_a_replicas_measured_draft_cost_decides_its_plans():
    planner = PlannerState()
    guessed = planner.report(report(acceptance={"x": (0.85, 40)}), now=0.0).num_drafts["x"]
    costly = planner.report(report(acceptance={"x": (0.85, 40)}, draft_cost=1.0), now=0.1).num_drafts["x"]
    cheap = planner.report(report(acceptance={"x": (0.85, 40)}, draft_cost=0.02), now=0.2).num_drafts["x"]
    assert guessed > 0 and costly == 0 and cheap == 4


def test_load_lowers_k_and_fixed_replicas_get_no_plan():
    planner = PlannerState()
    idle = planner.report(report(acceptance={"x": (0.6, 40)}), now=0.0).num_drafts["x"]
    queued = planner.report(report(acceptance={"x": (0.6, 40)}, pending=5), now=0.1).num_drafts["x"]
    assert queued < idle
    assert planner.report(report("r2", acceptance={"y": (0.9, 40)}, adaptive=False), now=0.2).num_drafts == {}


def test_prior_follows_the_cluster_acceptance():
    """The plan carries the cluster's acceptance once some replica measured it; before that no
    prior (a replica then measures its own before it judges that no depth pays)."""
    planner = PlannerState(prior_acceptance=0.6)
    assert planner.report(report(), now=0.0).prior_acceptance is None, "no trials reported: nothing measured"
    for t in range(20):
        plan = planner.report(report(acceptance={"a": (0.1, 50)}), now=0.1 + t * 0.1)
    assert planner.prior_acceptance < 0.2 and plan.prior_acceptance == planner.prior_acceptance


def test_grants_and_drain():
    planner = PlannerState()
    assert (planner.report(report(), 0.0).num_blocks_granted, planner.report(report(), 0.0).num_rows_granted) == (100, 8)
    planner.drain("r1")
    plan = planner.report(report(reserved_blocks=30), 0.1)
    assert (plan.num_blocks_granted, plan.num_rows_granted) == (0, 0)
    view = planner.placement(0.1)
    assert view.replicas["r1"].drained and view.replicas["r1"].headroom_blocks == -30
    planner.drain("r1", False)
    assert planner.report(report(), 0.2).num_blocks_granted == 100


def test_placement_view_and_session_binding():
    planner = PlannerState()
    planner.report(report("r1", running=3, reserved_blocks=50), 0.0)
    planner.report(report("r2", running=0), 0.0)
    view = planner.placement(0.0)
    assert view.replicas["r1"].num_running == 3 and view.replicas["r1"].kv_usage == 0.5
    assert view.replicas["r2"].headroom_blocks == 100
    assert planner.bind_session("s", "r2", 0.1) == "r2"
    assert planner.bind_session("s", "r1", 0.2) == "r2", "a live session keeps its replica"
    assert planner.placement(0.2).sessions == {"s": "r2"}


def test_view_is_rebuilt_after_a_worker_restart():
    planner = PlannerState(replica_ttl_s=5.0)
    planner.report(report("old", sessions=["s1"]), 0.0)
    planner.report(report("other", sessions=["s2"]), 0.0)
    # the 'old' replica died; Serve started 'new' in its place; 'other' keeps reporting
    planner.report(report("new"), 3.0)
    planner.report(report("other", sessions=["s2"]), 6.0)
    view = planner.placement(6.0)
    assert set(view.replicas) == {"new", "other"}
    assert view.sessions == {"s2": "other"}, "sessions of the dead replica are dropped for re-placement"
    # a restarted process reporting under the same id (new incarnation) starts with a clean slate
    planner.report(report("other", incarnation="i2"), 6.1)
    assert planner.placement(6.1).sessions == {}


def test_a_restarted_planner_rebuilds_from_one_round_of_reports():
    reports = [report("r1", sessions=["a", "b"], running=2), report("r2", sessions=["c"], pending=1)]
    before, after = PlannerState(), PlannerState()
    for r in reports:
        before.report(r, 1.0)
    for r in reports:                         # a fresh planner sees the next round only
        after.report(r, 2.0)
    vb, va = before.placement(2.0), after.placement(2.0)
    assert va.sessions == vb.sessions == {"a": "r1", "b": "r1", "c": "r2"}
    assert va.replicas == vb.replicas


def test_a_silent_replica_is_listed_for_a_liveness_check_and_forgetting_it_replaces_its_sessions():
    planner = PlannerState(replica_ttl_s=15.0)
    planner.report(report("a", sessions=("s1",)), now=0.0)
    planner.report(report("b"), now=0.0)
    planner.report(report("b"), now=2.0)
    assert [r.replica_id for r in planner.silent_replicas(now=2.0, after_s=1.0)] == ["a"]
    planner.forget("a")                 # the actor checked it and found it gone, long before the TTL
    view = planner.placement(now=2.1)
    assert set(view.replicas) == {"b"} and "s1" not in view.sessions
    assert planner.bind_session("s1", "b", now=2.2) == "b"


def test_the_session_table_is_bounded_by_last_use():
    """4,000 invented session ids cannot grow the planner past its bound; the recent ones stay."""
    planner = PlannerState(max_sessions=1000)
    planner.report(report(), now=0.0)
    for i in range(4000):
        planner.bind_session(f"s{i}", "r1", now=1.0 + i * 1e-3)
    planner.expire(now=5.0)
    assert len(planner.sessions) == 1000
    assert "s3999" in planner.sessions and "s0" not in planner.sessions
    assert len(planner.placement(now=5.0).sessions) == 1000


def test_the_view_carries_each_replicas_prefix_index_only_when_it_changed():
    planner = PlannerState()
    planner.report(report("r1", prefix_index=b"a" * 16, prefix_index_version=3), now=0.0)
    planner.report(report("r2", incarnation="i2"), now=0.0)
    assert planner.placement(now=0.1).prefix_indexes == {"r1": (3, b"a" * 16), "r2": (0, b"")}
    assert planner.placement(now=0.1, known={"r1": 3, "r2": 0}).prefix_indexes == {}
    planner.report(report("r1", prefix_index=b"b" * 8, prefix_index_version=4), now=0.2)
    assert planner.placement(now=0.3, known={"r1": 3, "r2": 0}).prefix_indexes == {"r1": (4, b"b" * 8)}


def test_routing_decisions_are_summed_over_routers():
    planner = PlannerState()
    planner.note_routing("proxy-1", {"prefix_hit": 3, "session": 1}, now=0.0)
    planner.note_routing("proxy-2", {"prefix_hit": 2, "prefix_miss": 5}, now=0.0)
    planner.note_routing("proxy-1", {"prefix_hit": 4, "session": 1}, now=1.0)     # its counts so far, not deltas
    assert planner.routing_counts() == {"prefix_hit": 6, "session": 1, "prefix_miss": 5}
