"""The planner's store of handed-over session prefixes, and the planner around it, without Ray:
a byte budget (oldest dropped), a TTL, take removes, the ids reach workers only when they change."""
from test_planner_state import report

from mtpserve.actors.handover import HandoverStore, records_size
from mtpserve.actors.planner import PlannerState


def records(num_bytes: int, tag: bytes = b"d") -> list[tuple[bytes, bytes]]:
    """One (digest, blob) record of ``num_bytes`` in all (an 8-byte digest)."""
    return [(tag.ljust(8, b"."), b"x" * (num_bytes - 8))]


def report_with(handover_version):
    """A report of replica r1 from a worker that holds this version of the handed-over ids."""
    r = report("r1")
    r.handover_version = handover_version
    return r


def test_take_returns_the_records_once():
    store = HandoverStore(max_bytes=1000)
    r = records(100)
    assert store.put("s", r, now=0.0)
    assert store.session_ids() == {"s"} and store.num_bytes == records_size(r) == 100
    assert store.take("s") == r
    assert store.take("s") is None and store.session_ids() == frozenset() and store.num_bytes == 0
    counts = store.counts()
    assert counts.sessions == {"handed_over": 1, "taken": 1} and counts.bytes == {"handed_over": 100, "taken": 100}


def test_over_the_budget_the_oldest_hand_overs_are_dropped():
    store = HandoverStore(max_bytes=300)
    for i, sid in enumerate("abc"):
        store.put(sid, records(100), now=float(i))
    assert store.num_bytes == 300
    store.put("d", records(150), now=3.0)                 # 450 > 300: a and b go, oldest first
    assert store.session_ids() == {"c", "d"} and store.num_bytes == 250
    assert not store.put("huge", records(301), now=4.0), "a session over the whole budget is refused"
    assert store.session_ids() == {"c", "d"}
    store.put("c", records(50), now=5.0)                   # a newer hand-over of c replaces the older
    assert store.num_bytes == 200 and store.take("c") == records(50)
    assert store.counts().sessions["dropped"] == 4         # a, b, huge, the older c


def test_hand_overs_expire_after_the_ttl():
    store = HandoverStore(max_bytes=1000, ttl_s=10.0)
    store.put("old", records(100), now=0.0)
    store.put("new", records(100), now=5.0)
    store.expire(now=10.0)
    assert store.session_ids() == {"old", "new"}
    store.expire(now=10.5)
    assert store.session_ids() == {"new"} and store.num_bytes == 100
    assert store.counts().sessions["expired"] == 1


def test_the_session_count_is_bounded_too():
    store = HandoverStore(max_bytes=10**9, max_sessions=3)
    for i in range(5):
        store.put(f"s{i}", records(16), now=float(i))
    assert store.session_ids() == {"s2", "s3", "s4"}


def test_the_planner_tells_workers_the_handed_over_sessions_only_when_they_change():
    planner = PlannerState(handover_max_bytes=1000)
    first = planner.report(report("r1"), now=0.0)
    assert first.handover_sessions == frozenset()          # a worker that knows no version gets the set
    version = first.handover_version
    same = planner.report(report_with(version), now=0.1)
    assert same.handover_sessions is None and same.handover_version == version
    planner.hand_over("gone", {"s": records(100)}, now=0.2)
    changed = planner.report(report_with(version), now=0.3)
    assert changed.handover_sessions == {"s"} and changed.handover_version != version
    assert planner.take_handover("s") == records(100) and planner.take_handover("s") is None
    assert planner.report(report_with(changed.handover_version), now=0.4).handover_sessions == frozenset()
    # a restarted planner's versions never match the old one's, even with as many changes
    assert PlannerState().report(report_with(version), now=0.5).handover_sessions == frozenset()


def test_a_hand_over_unbinds_the_sessions_from_the_stopping_replica():
    planner = PlannerState()
    planner.report(report("old", sessions=["moved", "kept"]), now=0.0)
    planner.report(report("other"), now=0.0)
    assert planner.hand_over("old", {"moved": records(64)}, now=0.1) == 1
    assert planner.placement(now=0.1).sessions == {"kept": "old"}
    assert planner.bind_session("moved", "other", now=0.2) == "other", "its next request is placed afresh"


def test_hand_overs_expire_with_the_planners_session_ttl():
    planner = PlannerState(session_ttl_s=60.0)
    planner.hand_over("old", {"s": records(64)}, now=0.0)
    planner.expire(now=61.0)
    assert planner.take_handover("s") is None
