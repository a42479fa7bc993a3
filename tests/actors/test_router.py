"""Replica ranking: sessions stick, a cached prefix attracts within a load bound, everything else
goes to the least loaded replica."""
import random
from collections import Counter

from mtpserve.actors.planner import ReplicaLoad
from mtpserve.actors.router import DRAINED_PENALTY, InFlight, prefer_cached, rank_replicas, replica_load, route


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


def test_a_burst_chosen_before_any_request_is_sent_spreads_evenly():
    """Serve's routing tasks choose a burst's replicas before the first is sent: each choice
    counts at once (counting only sent requests left 8 prompts at 7 and 1 now and then)."""
    rng = random.Random(0)
    for trial in range(20):
        in_flight, now = InFlight(), 100.0
        firsts = []
        for _ in range(8):
            loads = {r: replica_load(None, {}, in_flight.count(r, now)) for r in ("a", "b")}
            firsts.append(rank_replicas(["a", "b"], loads, None, rng)[0])
            in_flight.chosen(firsts[-1], now)
        assert Counter(firsts) == {"a": 4, "b": 4}, (trial, firsts)


def test_a_choice_becomes_a_sent_request_or_expires():
    in_flight = InFlight(tentative_s=1.0)
    in_flight.chosen("a", 0.0)
    in_flight.chosen("a", 0.5)
    assert in_flight.count("a", 0.6) == 2
    in_flight.sent("a")                        # the first choice went out: counted once, not twice
    assert in_flight.count("a", 0.6) == 2
    assert in_flight.count("a", 1.6) == 1, "a choice Serve sent elsewhere stops counting"
    in_flight.sent("b")                        # sent to b without being chosen there (a's queue was full)
    assert in_flight.count("b", 1.6) == 1
    in_flight.completed("a")
    in_flight.completed("a")
    assert in_flight.count("a", 1.6) == 0, "never below zero"


# ---- the prefix rule: order is rank_replicas's least-loaded order
def test_the_longest_cached_prefix_wins_over_a_shorter_one_and_over_load():
    loads = {"a": 0.0, "b": 2.0, "c": 3.0}
    assert prefer_cached(["a", "b", "c"], loads, {"b": 3, "c": 9}, max_imbalance=4) == (["c", "a", "b"], "hit")
    assert prefer_cached(["a", "b", "c"], loads, {"a": 3, "b": 9}, max_imbalance=4) == (["b", "a", "c"], "hit")
    assert prefer_cached(["a", "b", "c"], loads, {"a": 9, "b": 3}, max_imbalance=4) == (["a", "b", "c"], "hit")


def test_equal_matches_go_to_the_less_loaded():
    loads = {"a": 0.0, "b": 1.0, "c": 2.0}
    assert prefer_cached(["a", "b", "c"], loads, {"b": 5, "c": 5}, max_imbalance=4)[0][0] == "b"


def test_a_match_busier_than_the_bound_loses_to_the_least_loaded():
    loads = {"a": 0.0, "b": 4.0, "c": 5.0}
    assert prefer_cached(["a", "b", "c"], loads, {"c": 9}, max_imbalance=4) == (["a", "b", "c"], "overloaded")
    # exactly at the bound still counts as balanced
    assert prefer_cached(["a", "b", "c"], loads, {"b": 9}, max_imbalance=4) == (["b", "a", "c"], "hit")
    # the longest match is too busy: the longest one within the bound goes first
    assert prefer_cached(["a", "b", "c"], loads, {"b": 2, "c": 9}, max_imbalance=4) == (["b", "a", "c"], "hit")


def test_no_match_keeps_the_least_loaded_order():
    loads = {"a": 0.0, "b": 1.0}
    assert prefer_cached(["a", "b"], loads, {}, max_imbalance=4) == (["a", "b"], "miss")
    assert prefer_cached(["a", "b"], loads, {"gone": 7}, max_imbalance=4) == (["a", "b"], "miss"), \
        "a match on a replica that is no candidate (dead, or at its limit) is no match"


def test_a_session_keeps_its_replica_over_a_longer_cached_prefix_elsewhere():
    loads = {"a": 3.0, "b": 0.0}
    assert route(["a", "b"], loads, "a", {"b": 20}, max_imbalance=4) == (["a", "b"], "session")
    # a session whose owner is gone (or new) is placed by the prefix rule
    assert route(["b", "c"], {"b": 1.0, "c": 0.0}, "a", {"b": 20}, max_imbalance=4) == (["b", "c"], "prefix_hit")
    assert route(["b", "c"], {"b": 1.0, "c": 0.0}, None, {}, max_imbalance=4) == (["c", "b"], "prefix_miss")


def test_only_calls_that_generate_count_as_routed_requests():
    """/metrics' router_requests_total counts requests for tokens: a scrape of /metrics, /health,
    /v1/models or /tokenize is routed too, but counting it made an idle replica look busy with
    "no_prefix" requests (a Prometheus scraping every 15 s: 4 a minute)."""
    import pickle
    from types import SimpleNamespace

    from mtpserve.actors.router import _generates, _http_scope

    def http(method, path, pickled=False):
        arg = SimpleNamespace(asgi_scope={"method": method, "path": path})
        meta = SimpleNamespace(is_http_request=True, call_method="__call__")
        return SimpleNamespace(metadata=meta, args=[pickle.dumps(arg) if pickled else arg])

    def handle(method):
        return SimpleNamespace(metadata=SimpleNamespace(is_http_request=False, call_method=method), args=["hi"])
    for request, counted in ((http("POST", "/v1/completions"), True), (http("POST", "/v1/chat/completions/"), True),
                             (http("POST", "/v1/completions", pickled=True), True), (http("GET", "/metrics"), False),
                             (http("GET", "/health"), False), (http("GET", "/v1/models"), False),
                             (http("POST", "/tokenize"), False), (handle("generate"), True), (handle("stream"), True),
                             (handle("engine_status"), False), (None, False)):
        assert _generates(request, _http_scope(request)) is counted, request
