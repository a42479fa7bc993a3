"""Replica ranking: sessions stick, everything else goes to the least loaded replica."""
import random
from collections import Counter

from mtpserve.actors.planner import ReplicaLoad
from mtpserve.actors.router import DRAINED_PENALTY, rank_replicas, replica_load


def test_session_owner_comes_first_even_when_busier():
    loads = {"a": 5.0, "b": 0.0, "c": 1.0}
    assert rank_replicas(["a", "b", "c"], loads, session_owner="a") == ["a", "b", "c"]
    assert rank_replicas(["a", "b", "c"], loads, session_owner=None) == ["b", "c", "a"]
    assert rank_replicas(["b", "c"], loads, session_owner="a") == ["b", "c"], "a dead owner is skipped"


def test_ties_spread_over_replicas():
    rng = random.Random(0)
    firsts = Counter(rank_replicas(["a", "b", "c"], {}, None, rng)[0] for _ in range(300))
    assert set(firsts) == {"a", "b", "c"} and min(firsts.values()) > 60


def test_load_takes_the_fresher_of_reported_and_in_flight_counts():
    view = ReplicaLoad(num_running=2, num_pending=1, kv_usage=0.25, headroom_blocks=10, drained=False)
    assert replica_load(view, {}, num_in_flight=0) == 3.25
    assert replica_load(view, {}, num_in_flight=7) == 7.25, "a burst counts before the next report"
    stats = {"num_running": 1, "num_pending": 0, "kv_usage": 0.5}
    assert replica_load(None, stats, 0) == 1.5, "without a planner view, Serve's routing stats"
    drained = ReplicaLoad(0, 0, 0.0, 0, drained=True)
    assert replica_load(drained, {}, 0) >= DRAINED_PENALTY
