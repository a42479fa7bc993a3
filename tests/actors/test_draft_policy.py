"""The draft-count policy: K falls for a request whose drafts are rejected, rises when accepted."""
from types import SimpleNamespace

import pytest

from mtpserve.actors.draft_policy import (AcceptanceEMA, ActorDraftPolicy, DraftCostModel,
                                          choose_num_drafts, expected_tokens)
from mtpserve.engine.speculative import SpecDecodeStats


def test_expected_tokens_counts_the_bonus_token():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_choice_grows_with_acceptance_and_shrinks_with_load():
    ks = [choose_num_drafts(a / 10, 0.0, 7) for a in range(11)]
    assert ks[0] == 0 and ks[-1] == 7
    assert ks == sorted(ks), "K must not fall as acceptance rises"
    assert choose_num_drafts(0.7, 1.0, 7) <= choose_num_drafts(0.7, 0.0, 7)
    assert choose_num_drafts(0.7, 1.0, 7, DraftCostModel(draft_cost=1.0)) < choose_num_drafts(0.7, 1.0, 7)
    assert choose_num_drafts(0.95, 0.0, 2) == 2, "capped by max_drafts"


def test_ema_counts_only_the_positions_that_were_tried():
    ema = AcceptanceEMA(prior=0.5)
    for _ in range(50):
        ema.observe_step(num_drafts=4, num_accepted=1)   # one success, then one failure: 2 trials
    assert ema.value == pytest.approx(0.5, abs=0.02)
    assert ema.num_trials == 100
    high = AcceptanceEMA(prior=0.5)
    for _ in range(50):
        high.observe_step(4, 4)                           # all tried, all accepted
    assert high.value > 0.95


def _request(rid="r"):
    return SimpleNamespace(request_id=rid, stats=SpecDecodeStats())


def _drive(policy, req, accept_all: bool, num_steps: int) -> list[int]:
    """Run the engine's side of the loop: ask K, 'verify', record the outcome."""
    ks = []
    for _ in range(num_steps):
        k = policy.num_drafts(req)
        ks.append(k)
        accepted = k if accept_all else 0
        req.stats.record_step(k, accepted, accepted + 1)
    return ks


def test_policy_lowers_k_on_rejection_and_raises_it_on_acceptance():
    policy = ActorDraftPolicy(max_drafts=4, prior=0.6)
    req = _request()
    start = policy.num_drafts(req)
    assert 0 < start < 4
    rejected = _drive(policy, req, accept_all=False, num_steps=40)
    assert rejected[-1] <= 1 and min(rejected) == 0, f"K should fall to 0 (probing at 1): {rejected}"
    assert 1 in rejected[8:], "a request at K = 0 still probes with one draft now and then"
    accepted = _drive(policy, req, accept_all=True, num_steps=60)
    assert accepted[-1] == 4, f"K should climb back to the cap: {accepted}"
    assert policy.acceptance()["r"][0] > 0.9


def test_planner_plan_overrides_the_local_choice_and_finished_requests_are_forgotten():
    policy = ActorDraftPolicy(max_drafts=4)
    a, b = _request("a"), _request("b")
    policy.set_plan({"a": 3})
    assert policy.num_drafts(a) == 3
    assert policy.num_drafts(b) == choose_num_drafts(0.6, 0.0, 4)
    policy.set_plan({"a": 9})
    assert policy.num_drafts(a) == 4, "the cap still applies to planned counts"
    policy.forget("a")
    assert set(policy.acceptance()) == {"b"}
