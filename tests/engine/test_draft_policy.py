"""The draft-count policy: K falls for a request whose drafts are rejected, rises when accepted."""
from types import SimpleNamespace

import numpy as np
import pytest

from mtpserve.engine.draft_policy import (
    AcceptanceEMA,
    AdaptiveDraftPolicy,
    DraftCostModel,
    DraftPolicy,
    FixedDraftPolicy,
    StepCostEstimator,
    choose_num_drafts,
    expected_tokens,
)
from mtpserve.engine.engine import StepTiming
from mtpserve.engine.sampler import SamplingParams


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


def _request(rid="r", params=SamplingParams(temperature=0)):
    return SimpleNamespace(request_id=rid, params=params)


def _drive(policy, req, accept_all: bool, num_steps: int) -> list[int]:
    """Run the engine's side of the loop: ask K, 'verify', report the outcome and the step."""
    ks = []
    for _ in range(num_steps):
        k = policy.num_drafts(req)
        ks.append(k)
        policy.observe_verified(req.request_id, k, k if accept_all else 0)
        policy.observe_step(None)
    return ks


def test_policy_lowers_k_on_rejection_and_raises_it_on_acceptance():
    policy = AdaptiveDraftPolicy(max_drafts=4, prior=0.6)
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
    policy = AdaptiveDraftPolicy(max_drafts=4)
    a, b = _request("a"), _request("b")
    policy.set_plan({"a": 3})
    assert policy.num_drafts(a) == 3
    assert policy.num_drafts(b) == choose_num_drafts(0.6, 0.0, 4)
    policy.set_plan({"a": 9})
    assert policy.num_drafts(a) == 4, "the cap still applies to planned counts"
    policy.forget("a")
    assert set(policy.acceptance()) == {"b"}


# ---- the measured step-cost model -----------------------------------------------------------


def feed(estimator, a, b, c, steps=200, seed=0):
    import random
    rnd = random.Random(seed)
    for _ in range(steps):
        batch, k = rnd.randrange(1, 17), rnd.choice([0, 1, 2, 3])
        tokens = batch * (1 + k)
        estimator.observe(StepTiming(batch, tokens, k, False, a + b * tokens + c * k))


def test_step_cost_estimator_recovers_the_cost_of_a_draft_level():
    est = StepCostEstimator(min_steps=10)
    assert est.draft_cost() is None                       # nothing seen yet
    feed(est, a=1e-3, b=3e-4, c=6e-4)
    a, b, c = est.coefficients()
    assert (a, b, c) == pytest.approx((1e-3, 3e-4, 6e-4), rel=1e-3)
    batch = est._batch
    assert est.draft_cost() == pytest.approx((b * batch + c) / (a + b * batch), rel=1e-3)


def test_step_cost_estimator_needs_steps_with_different_draft_counts_and_skips_prefill():
    est = StepCostEstimator(min_steps=4)
    for _ in range(50):
        est.observe(StepTiming(8, 32, 3, False, 0.01))    # always K=3: head cost not separable
        est.observe(StepTiming(8, 400, 0, True, 0.5))     # prefill steps are another regime
    assert est.draft_cost() is None
    est.observe(StepTiming(8, 8, 0, False, 0.004))
    assert est.num_steps == 51


def test_a_one_off_stall_stays_out_of_the_fit_but_a_lasting_change_gets_in():
    """A 0.4 s step among ~1 ms ones (the first burst's stall on the H200) once made every draft
    look as dear as a whole step for hundreds of steps; a cost that really changed is adopted."""
    est = StepCostEstimator(min_steps=10)
    feed(est, a=1e-3, b=3e-4, c=6e-4)
    before = est.draft_cost()
    est.observe(StepTiming(8, 24, 2, False, 0.4))
    assert est.num_outliers == 1
    assert est.draft_cost() == pytest.approx(before, rel=1e-6)
    feed(est, a=1e-3, b=3e-4, c=6e-4, steps=20, seed=1)

    def predict():
        return float(np.dot(est.coefficients(), [1.0, 24, 2]))
    old = predict()
    feed(est, a=1e-2, b=3e-3, c=6e-3, steps=50, seed=2)   # every step now costs 10x: the costs changed
    assert predict() > 2 * old, "a lasting change of the step costs must reach the fit"


def test_reset_step_costs_forgets_the_start_up_steps():
    policy = AdaptiveDraftPolicy(4, prior=0.85, explore_interval=0)
    feed(policy.estimator, a=0.0, b=1e-3, c=0.0)
    policy.observe_step(None)
    assert policy.num_drafts(_request()) == 0              # measured: drafts cost whole steps
    policy.reset_step_costs()
    assert policy.estimator.num_steps == 0 and policy.estimator.draft_cost() is None
    assert policy.num_drafts(_request("b")) == choose_num_drafts(0.85, 0.0, 4)   # the static guess again


def test_measured_expensive_drafts_turn_drafting_off_and_cheap_ones_on():
    def decide(a, b, c):
        policy = AdaptiveDraftPolicy(4, prior=0.85, explore_interval=0)
        feed(policy.estimator, a, b, c)
        policy.observe_step(None)                      # the next step plans with the measured model
        return policy.num_drafts(_request())

    # each draft level costs a whole plain step (a compute-bound CPU batch): no drafting pays
    assert decide(a=0.0, b=1e-3, c=0.0) == 0
    # drafts nearly free next to the fixed cost of a step (a memory-bound GPU): draft deep
    assert decide(a=10e-3, b=1e-5, c=1e-5) == 4


def test_every_explore_interval_th_step_drafts_nothing():
    policy = AdaptiveDraftPolicy(4, prior=0.95, explore_interval=4)
    ks = []
    for _ in range(8):
        ks.append(policy.num_drafts(_request()))
        policy.observe_step(None)
    assert ks[3] == ks[7] == 0 and all(k > 0 for i, k in enumerate(ks) if i not in (3, 7))


def test_a_seeded_sampled_request_gets_the_same_k_whatever_the_load_and_exploration():
    def ks(load, explore_interval, plan):
        policy = AdaptiveDraftPolicy(4, explore_interval=explore_interval)
        policy.set_load(load)
        policy.set_plan(plan)
        req = _request("s", SamplingParams(temperature=0.8, seed=7))
        out = []
        for _ in range(10):
            out.append(policy.num_drafts(req))
            policy.observe_step(None)
        return out

    assert ks(0.0, 0, {}) == ks(1.0, 3, {"s": 0}) == ks(0.5, 2, {"s": 4})


def test_fixed_draft_policy():
    assert FixedDraftPolicy(3).num_drafts(object()) == 3
    assert FixedDraftPolicy(7).num_drafts(None) == 7, "MAX_NUM_DRAFTS itself is allowed"
    assert FixedDraftPolicy(0).num_drafts(None) == 0
    for bad in (-1, 8, 2.0, True):
        with pytest.raises(ValueError, match="num_drafts"):
            FixedDraftPolicy(bad)
    with pytest.raises(NotImplementedError):
        DraftPolicy().num_drafts(None)


def test_a_uniform_step_takes_the_median_and_probes_one_draft_when_it_is_zero():
    """step_num_drafts (one K for a captured step): the median of the requests' wishes; a step
    whose median is 0 drafts one token every probe_interval-th step, except when exploring."""
    assert FixedDraftPolicy(2).step_num_drafts([2, 2, 2]) == 2
    policy = AdaptiveDraftPolicy(4, probe_interval=4, explore_interval=8)
    assert policy.step_num_drafts([0, 3, 3, 1]) == 3
    ks = []
    for _ in range(16):
        ks.append(policy.step_num_drafts([0, 0, 1]))
        policy.observe_step(None)
    # steps are counted from 1: probes on steps 4 and 12; 8 and 16 explore (no probe there)
    assert [i + 1 for i, k in enumerate(ks) if k] == [4, 12]
