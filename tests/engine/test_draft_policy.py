"""The draft-count policy (``--draft-tokens auto``): the depth a step drafts follows acceptance
and the measured step cost, and in a closed loop of simulated steps it stays near the best fixed
K under host costs of several shapes."""
from types import SimpleNamespace

import numpy as np
import pytest

from mtpserve.engine.acceptance import ArrivalRate
from mtpserve.engine.draft_policy import (
    AdaptiveDraftPolicy,
    DraftCostModel,
    DraftPolicy,
    FixedDraftPolicy,
    best_depth,
    choose_num_drafts,
)
from mtpserve.engine.engine import StepTiming
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.step_costs import StepCostTable, batch_class, linear_seconds


def test_choice_grows_with_acceptance_and_shrinks_with_load():
    ks = [choose_num_drafts(a / 10, 0.0, 7) for a in range(11)]
    assert ks[0] == 0 and ks[-1] == 7
    assert ks == sorted(ks), "K must not fall as acceptance rises"
    assert choose_num_drafts(0.7, 1.0, 7) <= choose_num_drafts(0.7, 0.0, 7)
    assert choose_num_drafts(0.7, 1.0, 7, DraftCostModel(draft_cost=1.0)) < choose_num_drafts(0.7, 1.0, 7)
    assert choose_num_drafts(0.95, 0.0, 2) == 2, "capped by max_drafts"


def _request(rid="r", params=SamplingParams(temperature=0)):
    return SimpleNamespace(request_id=rid, params=params)


def linear_cost(a, b, c, h=0.0):
    """Step seconds of a decode step: a + b * main rows + c * head forwards (+ h * head rows)."""
    return lambda rows, depth, head_rows=0: a + b * rows + c * depth + h * head_rows


def measured(policy, a, b, c):
    """Feed the policy's step-cost fits steps of this cost at batches 1..16 and depths 0..3 (a
    replica's history: every batch-size class fitted)."""
    for i in range(256):
        batch, k = 1 + i % 16, (i // 16) % 4
        policy.fit_for(batch).observe(StepTiming(batch, batch * (1 + k), k, False, a + b * batch * (1 + k) + c * k))
    return policy


def _drive(policy, reqs, accept_all: bool, num_steps: int, cost=linear_cost(1e-3, 1e-5, 1e-5)) -> list[int]:
    """Run the engine's side of the loop: plan a uniform step, 'verify', report it."""
    ks = []
    for _ in range(num_steps):
        k = policy.step_drafts(reqs, uniform=True)[0]
        ks.append(k)
        for r in reqs:
            policy.observe_verified(r.request_id, k, k if accept_all else 0)
        rows = len(reqs) * (1 + k)
        policy.observe_step(StepTiming(len(reqs), rows, k, False, cost(rows, k)))
    return ks


def test_before_the_cost_is_measured_steps_alternate_zero_and_one_draft():
    """No guess of the step cost: a deep guess where drafts are dear lost a quarter of the
    tokens/s; 0 and 1 by turns is what the fit needs and costs little anywhere."""
    policy = AdaptiveDraftPolicy(4, prior=0.95)
    reqs = [_request(f"r{i}") for i in range(4)]
    ks = _drive(policy, reqs, accept_all=True, num_steps=policy.estimator.min_steps)
    assert ks == [0, 1] * (len(ks) // 2)
    assert policy.estimator.coefficients() is not None
    assert _drive(policy, reqs, accept_all=True, num_steps=3) == [2, 3, 4], \
        "cheap drafts, all accepted: up to the cap, a depth at a time (the fit is trusted one past what it saw)"


def test_each_batch_size_class_has_a_fit_of_its_own():
    """Hundreds of steps at one request where drafting is cheap say nothing of 16 requests: the
    first steps at 16 calibrate (0, 1, ...) instead of extrapolating to deep drafts."""
    policy = AdaptiveDraftPolicy(4, prior=0.9)
    one, many = [_request("a")], [_request(f"m{i}") for i in range(16)]
    _drive(policy, one, accept_all=True, num_steps=200, cost=linear_cost(1e-3, 1e-5, 1e-5))
    assert policy.step_drafts(one, uniform=True) == [4]
    assert [policy.step_drafts(many, uniform=True)[0] for _ in range(4)] == [0, 1, 0, 1]
    assert batch_class(1) != batch_class(16) and batch_class(16) == batch_class(31) != batch_class(32)


def test_a_new_class_beside_one_where_drafting_does_not_pay_does_not_calibrate():
    """16 requests where a draft level costs a whole step: K=0. As they finish, the batch falls
    into classes without a fit of their own; their first steps take the nearest class's verdict
    (no drafting) instead of calibrating 0, 1, 0, 1, whose drafting steps would make the head
    catch up on every position since each request last drafted. Beside a class where drafting
    pays, a new class still calibrates."""
    dear = linear_cost(1e-3, 1e-3, 1e-3)
    policy = AdaptiveDraftPolicy(4, prior=0.3, idle_explore_interval=0)
    many = [_request(f"m{i}") for i in range(16)]
    _drive(policy, many, accept_all=False, num_steps=40, cost=dear)
    assert policy.step_drafts(many, uniform=True) == [0] * 16
    fewer = many[:9]                                   # class 8-15: no fit of its own yet
    assert policy.fit_for(len(fewer)).coefficients() is None
    assert _drive(policy, fewer, accept_all=False, num_steps=8, cost=dear) == [0] * 8
    cheap = AdaptiveDraftPolicy(4, prior=0.9)
    _drive(cheap, many, accept_all=True, num_steps=60, cost=linear_cost(1e-3, 1e-6, 1e-6))
    assert [cheap.step_drafts(fewer, uniform=True)[0] for _ in range(4)] == [0, 1, 0, 1]


def test_the_depth_falls_on_rejection_and_climbs_back_on_acceptance():
    cost = (1e-3, 1e-5, 3e-4)
    policy = measured(AdaptiveDraftPolicy(4, prior=0.6, explore_interval=8, idle_explore_interval=16), *cost)
    reqs = [_request("r")]
    rejected = _drive(policy, reqs, accept_all=False, num_steps=60, cost=linear_cost(*cost))
    assert rejected[-16:].count(0) == 15, f"K should fall to 0: {rejected}"
    assert 1 in rejected[-16:], "a step at K = 0 still explores one draft every idle_explore_interval steps"
    accepted = _drive(policy, reqs, accept_all=True, num_steps=60, cost=linear_cost(*cost))
    assert accepted[-8:].count(4) == 7, f"K should climb back to the cap (one step in 8 explores 3): {accepted}"
    assert accepted.index(4) < 48, "back at the cap within a few idle explorations"
    assert policy.acceptance()["r"][0] > 0.9


def test_the_depth_maximises_the_steps_tokens_summed_over_its_requests():
    """One depth for the step: the head's forwards are paid once for everyone, so a request
    that drafts well carries the step's depth even beside one that does not."""
    cheap_rows = (1e-3, 1e-6, 1e-4, 0.0)
    assert best_depth([0.9, 0.9], [4, 4], linear_seconds(cheap_rows), 4, uniform=True) == 4
    assert best_depth([0.05, 0.05], [4, 4], linear_seconds(cheap_rows), 4, uniform=True) == 0
    assert best_depth([0.95, 0.05, 0.05, 0.05], [4] * 4, linear_seconds(cheap_rows), 4, uniform=True) >= 2
    # a draft level costs as much as the plain step itself: nothing pays
    assert best_depth([0.9] * 8, [4] * 8, linear_seconds((0.0, 1e-3, 0.0, 0.0)), 4, uniform=True) == 0
    # caps (the planner's counts) hold each request at its own count without a uniform step
    dear_rows = (1e-3, 5e-4, 1e-5, 0.0)
    assert best_depth([0.95, 0.95], [4, 0], linear_seconds(dear_rows), 4, uniform=False) >= 1
    assert best_depth([1.0], [4], linear_seconds((1e-3, 0.0, 0.0, 0.0)), 4, uniform=True) == 4, "alpha 1: every draft kept"
    # the head's catch-up of each drafting request's kept tokens is part of a draft's price
    assert best_depth([0.6] * 8, [4] * 8, linear_seconds((1e-3, 1e-5, 1e-5, 0.0)), 4, uniform=True) >= 2
    assert best_depth([0.6] * 8, [4] * 8, linear_seconds((1e-3, 1e-5, 1e-5, 2e-4)), 4, uniform=True) == 0


def _tokens_per_second(alphas, caps, coef, depth, uniform, profile=None):
    """The plain definition: every request's expected tokens at depth D over the step's cost
    (position d kept with probability min(1, alpha * profile[d-1]) given the ones before)."""
    a, b, c, h = coef
    ks = [depth if uniform else min(depth, cap) for cap in caps]

    def expected(al, k):
        rates = [min(1.0, max(al, 0.0) * (profile[d] if profile else 1.0)) for d in range(k)]
        return 1.0 + sum(float(np.prod(rates[:j + 1])) for j in range(k))
    tokens = sum(expected(al, k) for al, k in zip(alphas, ks))
    head_rows = sum(expected(al, k) for al, k in zip(alphas, ks) if k)
    return tokens / (a + b * (len(alphas) + sum(ks)) + c * depth + h * head_rows)


def test_best_depth_is_the_brute_force_argmax():
    """The sums by depth against the plain definition: every D, every request's expected tokens."""
    import random
    rnd = random.Random(3)
    for _ in range(300):
        n, top, uniform = rnd.randrange(1, 60), rnd.randrange(0, 8), rnd.random() < 0.5   # both paths (numpy past 24)
        alphas = [rnd.random() for _ in range(n)]
        caps = [rnd.randrange(0, 8) for _ in range(n)]
        coef = rnd.uniform(0, 2e-3), rnd.uniform(0, 1e-4), rnd.uniform(0, 5e-4), rnd.uniform(0, 1e-4)
        profile = [rnd.uniform(0.6, 1.3) for _ in range(8)] if rnd.random() < 0.5 else None
        values = [_tokens_per_second(alphas, caps, coef, d, uniform, profile) for d in range(top + 1)]
        got = best_depth(alphas, caps, linear_seconds(coef), top, uniform, profile)
        assert values[got] >= max(values) * (1 - 1e-9), (got, values)


def test_the_planners_counts_cap_each_request_and_finished_requests_are_forgotten():
    policy = measured(AdaptiveDraftPolicy(4, prior=0.95, explore_interval=0), 1e-3, 1e-6, 1e-5)
    a, b, c = _request("a"), _request("b"), _request("c")
    assert policy.step_drafts([a, b], uniform=False) == [4, 4]
    policy.set_plan({"a": 1, "c": 0})
    assert policy.step_drafts([a, b, c], uniform=False) == [1, 4, 0]
    assert policy.step_drafts([a, b, c], uniform=True) == [1, 1, 1], "uniform: the planned counts' median caps it"
    policy.set_plan({"a": 9})
    assert policy.step_drafts([a], uniform=False) == [4], "the engine's cap still applies to planned counts"
    policy.forget("a")
    assert set(policy.acceptance()) == {"b", "c"}


def test_a_new_request_starts_from_the_replicas_measured_acceptance():
    policy = measured(AdaptiveDraftPolicy(4, prior=0.6, explore_interval=0), 1e-3, 1e-5, 1e-4)
    assert policy.acceptance() == {}
    _drive(policy, [_request("old")], accept_all=True, num_steps=60)
    policy.forget("old")
    policy.step_drafts([_request("new")], uniform=True)
    assert policy.acceptance()["new"][0] > 0.9, "the replica accepts nearly every draft: start there, not at 0.6"


# ---- the measured step-cost model -----------------------------------------------------------


def test_the_depth_judged_once_for_unchanged_inputs_is_the_depth_judged_afresh():
    """step_drafts reuses best_depth's answer while the step's acceptances and caps and the
    costs are the ones it was judged on (and, before reading the acceptances, while the step's
    requests and the versions of acceptance, plan and costs are the last step's): over a random history of steps, joins, ends,
    verifications, plans and refits it answers exactly as a policy that judges every step, on
    the fits (seeds 0-3) and on a timed table (seeds 4-5: its key also holds the acceptance by
    position and the join rate)."""
    import random
    table = StepCostTable({(n, d): (1.0 + 0.6 * d) * 1e-3 * (1 + n / 8) for n in (1, 4, 16) for d in range(4)},
                          {(n, d): 2e-3 for n in (1, 4, 16) for d in range(1, 4)})
    for seed in range(6):
        rnd = random.Random(seed)
        kept, fresh = (AdaptiveDraftPolicy(3, explore_interval=5, min_prior_trials=4,
                                           cost_table=table if seed >= 4 else None) for _ in range(2))
        running, ended, next_id, reused = [f"r{i}" for i in range(6)], [], 6, 0
        for step in range(2000):
            for event in [rnd.random() for _ in range(rnd.choice([1, 1, 2]))]:     # between two steps
                if event < 0.1 and len(running) > 1:                # a request ends
                    ended.append(running.pop(rnd.randrange(len(running))))
                    for p in (kept, fresh):
                        p.forget(ended[-1])
                elif event < 0.2 and len(running) < 20:             # one joins, at times under an
                    if ended and rnd.random() < 0.5:                # ended one's id (a client's own)
                        running.append(ended.pop())
                    else:
                        running.append(f"r{next_id}")
                        next_id += 1
                elif event < 0.28:                                  # the planner's counts
                    plan = {r: rnd.choice([0, 0, 1, 3]) for r in running if rnd.random() < 0.7}
                    prior = rnd.choice([None, rnd.random()])
                    for p in (kept, fresh):
                        p.set_plan(plan, prior)
            out = rnd.choice(running) if len(running) > 1 and rnd.random() < 0.3 else None  # in a prompt chunk
            stepping = [r for r in running if r != out]
            reqs = [_request(r) for r in stepping]
            uniform = rnd.random() < 0.7
            fresh._judged = fresh._same_step = None                 # judged afresh, every step
            judged = kept._judged
            answer = kept.step_drafts(reqs, uniform)
            assert answer == fresh.step_drafts(reqs, uniform), f"seed {seed} step {step}"
            reused += judged is not None and kept._judged is judged      # its last answer, not judged again
            depth = max(answer)
            alpha = 0.9 if (step // 300) % 2 else 0.3              # acceptance changes by phases
            for r, k in zip(stepping, answer):
                if k and rnd.random() < 0.5:
                    accepted = next((j for j in range(k) if rnd.random() > alpha), k)
                    for p in (kept, fresh):
                        p.observe_verified(r, k, accepted)
            per_draft = 3e-4 if (step // 250) % 2 else 1e-6              # drafts dear, then cheap
            seconds = 1e-3 + 2e-5 * len(stepping) * (1 + depth) + per_draft * depth
            for p in (kept, fresh):
                p.observe_step(StepTiming(len(stepping), len(stepping) * (1 + depth), depth, False, seconds))
        assert reused > 100, "the answer was reused on few steps: the test exercised little"
    # a request ends and another comes under its id before the next step: a new estimate
    policy = measured(AdaptiveDraftPolicy(3, explore_interval=0, min_prior_trials=1), 1e-3, 1e-5, 1e-4)
    for _ in range(40):
        policy.observe_verified("b", 3, 3)                  # b's drafts all kept: depth 3 pays
    for _ in range(400):                                    # the replica's own acceptance: low
        policy.observe_verified("x", 3, 0)
    assert policy.step_drafts([_request("b")], uniform=True) == [3]
    policy.forget("b")
    assert policy.step_drafts([_request("b")], uniform=True) == [0], "judged on the ended request's estimate"


def test_forget_start_up_forgets_the_start_up_steps_and_their_acceptance():
    """The engine's warm-up requests draft on made-up prompts: neither their step times nor
    their acceptance are the workload's."""
    policy = measured(AdaptiveDraftPolicy(4, prior=0.85, explore_interval=0), 0.0, 1e-3, 0.0)
    assert policy.step_drafts([_request()], uniform=True) == [0]            # measured: drafts cost whole steps
    for _ in range(200):
        policy.observe_verified("r", 4, 0)
    assert policy.replica_acceptance.value < 0.3 and policy.acceptance()["r"][0] < 0.3
    policy.forget_start_up()
    assert policy.acceptance() == {} and policy.replica_acceptance.num_trials == 0
    assert policy.replica_acceptance.value == 0.85
    assert policy.estimator.num_steps == 0 and policy.estimator.draft_cost() is None
    assert policy.step_drafts([_request("b")], uniform=True) == [0]          # calibrating again: 0, then 1
    assert policy.step_drafts([_request("b")], uniform=True) == [1]


def test_measured_expensive_drafts_turn_drafting_off_and_cheap_ones_on():
    def decide(a, b, c):
        policy = measured(AdaptiveDraftPolicy(4, prior=0.85, explore_interval=0), a, b, c)
        return policy.step_drafts([_request(f"r{i}") for i in range(8)], uniform=True)[0]

    # each draft level costs a whole plain step (a compute-bound CPU batch): no drafting pays
    assert decide(a=0.0, b=1e-3, c=0.0) == 0
    # drafts nearly free next to the fixed cost of a step (a memory-bound GPU): draft deep
    assert decide(a=10e-3, b=1e-5, c=1e-5) == 4


def test_exploring_steps_take_a_neighbouring_depth_by_turns():
    policy = measured(AdaptiveDraftPolicy(4, prior=0.6, explore_interval=4), 1e-3, 1e-5, 2e-4)
    reqs = [_request(f"r{i}") for i in range(4)]
    ks = []
    for _ in range(16):
        for r in reqs:
            policy._track(r.request_id).value = 0.6            # hold acceptance where K = 2 is best
        ks.append((policy.explores(2), policy.step_drafts(reqs, uniform=True)[0]))
        policy.observe_step(None)
    best = {k for e, k in ks if not e}
    assert best == {2}, ks
    explored = [k for e, k in ks if e]
    assert sorted(explored) == [1, 1, 3, 3] and explored[0] != explored[1] and explored[:2] == explored[2:], ks
    zero = measured(AdaptiveDraftPolicy(4, prior=0.05, explore_interval=4, idle_explore_interval=32), 0.0, 1e-3, 0.0)
    zero.set_plan({}, prior=0.05)                       # a measured acceptance (the planner's), not a guess
    zero._step_index = 4
    assert zero.step_drafts(reqs, uniform=True) == [0] * 4, "held at 0: drafting again costs the head's catch-up"
    zero._step_index = 32
    assert zero.step_drafts(reqs, uniform=True) == [1] * 4, "at K = 0 every idle_explore_interval-th step drafts one"
    zero.set_plan({r.request_id: 0 for r in reqs})
    assert zero.step_drafts(reqs, uniform=False) == [1] * 4, "the planner's 0 too: acceptance keeps moving"


def test_no_depth_pays_is_judged_on_measured_acceptance_not_on_the_guess():
    """With only the guessed prior acceptance, a fit's "no depth pays" does not stop drafting:
    the steps calibrate (0, 1, 0, 1) until the replica has measured min_prior_trials trials;
    measured poor, the depth is held at 0."""
    policy = measured(AdaptiveDraftPolicy(4, prior=0.05, explore_interval=0, idle_explore_interval=0), 0.0, 1e-3, 0.0)
    reqs = [_request(f"r{i}") for i in range(4)]
    assert [policy.step_drafts(reqs, uniform=True)[0] for _ in range(4)] == [0, 1, 0, 1]
    for r in reqs:
        for _ in range(4):
            policy.observe_verified(r.request_id, 1, 0)        # 16 trials, every draft rejected
    assert [policy.step_drafts(reqs, uniform=True)[0] for _ in range(4)] == [0] * 4


def test_fixed_draft_policy():
    assert FixedDraftPolicy(3).num_drafts(object()) == 3
    assert FixedDraftPolicy(7).num_drafts(None) == 7, "MAX_NUM_DRAFTS itself is allowed"
    assert FixedDraftPolicy(0).num_drafts(None) == 0
    assert FixedDraftPolicy(2).step_drafts([None] * 3, uniform=True) == [2, 2, 2]
    for bad in (-1, 8, 2.0, True):
        with pytest.raises(ValueError, match="num_drafts"):
            FixedDraftPolicy(bad)
    with pytest.raises(NotImplementedError):
        DraftPolicy().num_drafts(None)


# ---- closed loop: simulated steps against the best fixed K -----------------------------------


def closed_loop(policy, costs, batch: int, uniform: bool, seed: int = 0, num_tokens: int = 128,
                prompt_len: int = 32, alphas=(0.5, 0.9, 0.7), overlap: float = 0.0,
                num_requests: int | None = None, position_decay: float = 1.0, join_cost: float = 0.0) -> float:
    """Tokens per simulated second of ``num_requests`` (default ``4 * batch``) requests (a ``prompt_len``-token prompt,
    ``num_tokens`` out, ``batch`` at a time, a finished one replaced at once), each accepting a
    draft with its own alpha given the ones before it were accepted. A step costs
    ``a + b * main rows + c * depth + h * head catch-up rows`` (a request that drafts makes the
    head catch up on every position since it last drafted, its prompt included), with 10%
    jitter and a 10x stall now and then; the policy is told what the engine would tell it.

    ``overlap``: the share of that cost hidden when a step continues one of its own kind (a step
    without drafts after one without, a drafting step after a drafting one: the engine launches
    it before the one it follows lands); a step that changes kind runs alone and pays it all.
    ``position_decay``: draft i (from 0) is kept with probability alpha * position_decay^i given
    the ones before it (an MTP head's chained drafts are kept less often the deeper they are).
    ``join_cost``: seconds a request adds to the first step it drafts in (beyond the head's
    catch-up: the steps around a joining request's prompt that run alone)."""
    import random
    a, b, c, h, *fixed = costs
    e = fixed[0] if fixed else 0.0        # what any drafting step costs beyond its levels
    rnd = random.Random(seed)
    ids = iter(range(10**6))

    def new():
        i = next(ids)
        return SimpleNamespace(request_id=f"q{i}", params=SamplingParams(temperature=0),
                               alpha=alphas[i % len(alphas)], left=num_tokens, behind=prompt_len, fresh=True)
    running, started = [new() for _ in range(batch)], batch
    seconds = tokens = 0.0
    drafted_last = None
    while running:
        wanted = policy.step_drafts(running, uniform)
        ks = [max(0, min(k, 4, r.left - 1)) for k, r in zip(wanted, running)]
        rows, depth = sum(1 + k for k in ks), max(ks)
        catch_up = sum(r.behind for r, k in zip(running, ks) if k)
        step = (a + b * rows + c * depth + e * (depth > 0) + h * catch_up) * (1 + 0.1 * rnd.random()) * (10 if rnd.random() < 0.005 else 1)
        for r, k in zip(running, ks):
            if k and r.fresh:
                step += join_cost
                r.fresh = False
        pipelined = None
        if overlap:
            pipelined = drafted_last == (depth > 0)
            step *= (1.0 - overlap) if pipelined else 1.0
            drafted_last = depth > 0
        for r, k in zip(running, ks):
            accepted = 0
            while accepted < k and rnd.random() < r.alpha * position_decay ** accepted:
                accepted += 1
            policy.observe_verified(r.request_id, k, accepted)
            r.behind = (0 if k else r.behind) + 1 + accepted
            r.left -= 1 + accepted
            tokens += 1 + accepted
        policy.observe_step(StepTiming(len(running), rows, depth, False, step, num_head_rows=catch_up, pipelined=pipelined))
        seconds += step
        for r in [r for r in running if r.left <= 0]:
            policy.forget(r.request_id)
            running.remove(r)
            if started < (num_requests or 4 * batch):
                running.append(new())
                started += 1
    return tokens / seconds


# (a, b, c, h): seconds per step, per main-model row, per head forward, per head catch-up row
HOST_BOUND_GPU = (0.5e-3, 23e-6, 0.38e-3, 1e-6)   # the bundled model's graph steps on the H200 (phase probe)
CHEAP_DRAFTS = (0.6e-3, 5e-6, 0.12e-3, 1e-6)     # drafting pays: K = 1..4 beat K = 0
COMPUTE_BOUND_CPU = (4.3e-3, 0.7e-3, 1.5e-3, 0.1e-3)   # the bundled model on a 2-core CPU (cProfile)
MODERATE_DRAFTS = (0.35e-3, 0.05e-3, 0.2e-3, 5e-6)    # the bundled model on the H200 after 2026-12-02: K=0 0.57 ms,
                                                      # K=2 1.07 ms a step at one request; drafting pays ~1.2x

# (a, b, c, h, e): the bundled model's steps at 16 requests on the H200 (session as, 2026-12-04:
# K=0 0.49 ms, K=2 1.35, K=3 1.60 a step): a drafting step pays e = 0.37 ms before its levels
# (the verify graph, the accept, the head's first forward and the host's drafting path)
H200_DRAFTING_STEP = (0.332e-3, 10e-6, 86e-6, 1e-6, 0.37e-3)

MIXED_ALPHAS = (0.5, 0.9, 0.7)
BUNDLED_ALPHAS = (0.93, 0.9, 0.95)                    # the bundled model's first-draft acceptance is ~0.9


# the bound for auto against the best fixed K. With moderate costs and high acceptance the steps'
# depth moves with each request's acceptance estimate (1..4 around a best fixed K of 3), which costs
# ~4%: 0.95 there (before "no depth pays" waited for measured acceptance, 0.89x)
@pytest.mark.parametrize("costs,uniform,alphas,bound", [(HOST_BOUND_GPU, True, MIXED_ALPHAS, 0.96),
                                                        (CHEAP_DRAFTS, True, MIXED_ALPHAS, 0.96),
                                                        (COMPUTE_BOUND_CPU, False, MIXED_ALPHAS, 0.96),
                                                        (MODERATE_DRAFTS, True, BUNDLED_ALPHAS, 0.95)])
@pytest.mark.parametrize("batch", [1, 16])
def test_auto_stays_near_the_best_fixed_k_in_a_closed_loop(costs, uniform, alphas, bound, batch):
    _closed_loop_against_fixed(costs, uniform, alphas, bound, batch)


@pytest.mark.xfail(strict=True, reason="known gap (issue 11): the step-cost fit is a line in the draft levels and "
                   "sees steps that change kind run alone; on the H200's cost shape auto falls below K=0 or the best")
@pytest.mark.parametrize("overlap", [0.0, 0.3])
def test_auto_finds_deep_drafts_when_drafting_steps_have_a_fixed_cost(overlap):
    """The H200's cost shape at one request: a drafting step pays ~0.37 ms before its levels, so
    K=1 loses to K=0 where K=3-4 win (1.26-1.28x at the bundled model's acceptance). A fit
    linear in the levels reads the first level's price into every level and stays at K=0
    (~0.76x the best). With ``overlap`` (a step that continues one of its kind hides 30% of its
    cost; one that changes kind, every exploring step, runs alone and pays it all), auto fell to
    0.87-0.94x K=0 with the H200's C=16 costs in simulation: the steps around its explorations
    cost more than the fit's K=0 steps said. On the device the same gap showed as two stable
    states at C=16 (held at K=0, or held deep at 0.55-0.80x K=0: results/h200 sessions ax, ay).
    A fit with a drafting term (tried 2026-12-04) passed the first case at 0.93x in simulation
    but drafted at C=8 / 16 on the H200 (0.66x / 0.74x K=0, session az)."""
    costs = tuple(x / (1.0 - overlap) for x in H200_DRAFTING_STEP)       # steady costs as measured
    _closed_loop_against_fixed(costs, True, BUNDLED_ALPHAS, 0.92, 1, overlap=overlap)


def _closed_loop_against_fixed(costs, uniform, alphas, bound, batch, overlap=0.0):
    """--draft-tokens auto's goal, in simulation: within a few percent of the best fixed K and
    never far below K = 0, whether drafting pays or not (the old per-request choice, with a deep
    start-up guess and clipped coefficients, came to 0.87-0.90x of the best in some of these;
    without the catch-up term in the fit, 0.86x at C=1 with CPU costs; judging "no depth pays"
    on the guessed prior acceptance, 0.93x with the moderate costs at one request)."""
    seeds = range(3)           # one seed's best fixed K is the luckiest of five noisy runs
    fixed = {k: sum(closed_loop(FixedDraftPolicy(k), costs, batch, uniform, s, alphas=alphas, overlap=overlap)
                    for s in seeds) for k in range(5)}
    auto = sum(closed_loop(AdaptiveDraftPolicy(4), costs, batch, uniform, s, alphas=alphas, overlap=overlap)
               for s in seeds)
    best = max(fixed, key=fixed.get)
    print(f"{costs} B={batch}: auto {auto / fixed[0]:.3f}x K=0, {auto / fixed[best]:.3f}x the best (K={best}); "
          + " ".join(f"K={k} {v / fixed[0]:.2f}" for k, v in fixed.items()))
    assert auto >= bound * fixed[best] and auto >= 0.96 * fixed[0]


# ---- overlapped steps: exploring in bursts, fitting the steps that ran behind another ----------


def _planned_depths(policy, reqs, steps: int) -> list[int]:
    """The depth ``policy`` plans for ``reqs`` step after step, every request's acceptance held
    at 0.6 (K = 2 is the best depth with ``measured``'s costs)."""
    ks = []
    for _ in range(steps):
        for r in reqs:
            policy._track(r.request_id).value = 0.6
        ks.append(policy.step_drafts(reqs, uniform=True)[0])
        policy.observe_step(None)
    return ks


def test_exploring_and_calibrating_depths_are_held_for_a_burst_of_steps():
    """``explore_burst``: the depth of an exploring (or calibrating) step is held for that many
    steps in a row, so that all but the first of them run behind one of their kind."""
    policy = measured(AdaptiveDraftPolicy(4, prior=0.6, explore_interval=8, explore_burst=3), 1e-3, 1e-5, 2e-4)
    reqs = [_request(f"r{i}") for i in range(4)]
    ks = _planned_depths(policy, reqs, 32)
    runs = [ks[i:i + 3] for i in range(7, 32, 8)]              # steps 8, 16, 24, 32 and the two after each
    assert all(len(set(run)) == 1 and run[0] != 2 for run in runs if len(run) == 3), ks
    assert [k for i, k in enumerate(ks) if (i + 1) % 8 not in (0, 1, 2)] == [2] * 20, ks
    fresh = AdaptiveDraftPolicy(4, prior=0.9, explore_burst=3)
    assert [fresh.step_drafts(reqs, uniform=True)[0] for _ in range(9)] == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="explore_burst"):
        AdaptiveDraftPolicy(4, explore_interval=8, explore_burst=8)


def test_calibration_bursts_hold_the_calibrating_depths_and_leave_exploring_single():
    """``calibration_burst`` (what an overlapped engine's auto uses): a batch size without a fit
    is calibrated at depths 0 and 1 in runs of that many steps; once fitted, its exploring steps
    stay single (``explore_burst``)."""
    reqs = [_request(f"r{i}") for i in range(4)]
    fresh = AdaptiveDraftPolicy(4, prior=0.9, calibration_burst=4)
    assert [fresh.step_drafts(reqs, uniform=True)[0] for _ in range(10)] == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    policy = measured(AdaptiveDraftPolicy(4, prior=0.6, explore_interval=8, calibration_burst=4), 1e-3, 1e-5, 2e-4)
    ks = _planned_depths(policy, reqs, 24)
    assert [k for i, k in enumerate(ks) if (i + 1) % 8 != 0] == [2] * 21 and 2 not in ks[7::8], ks
    with pytest.raises(ValueError, match="calibration_burst"):
        AdaptiveDraftPolicy(4, calibration_burst=0)


def _burst_policy():
    return AdaptiveDraftPolicy(4, explore_interval=64, explore_burst=4, fit_pipelined_only=True)


@pytest.mark.parametrize("costs,uniform,alphas", [(HOST_BOUND_GPU, True, MIXED_ALPHAS), (CHEAP_DRAFTS, True, MIXED_ALPHAS),
                                                  (MODERATE_DRAFTS, True, BUNDLED_ALPHAS)])
@pytest.mark.parametrize("batch", [1, 16])
def test_with_overlapped_steps_bursts_and_a_pipelined_fit_stay_near_the_best(costs, uniform, alphas, batch):
    """An engine that overlaps steps of one kind hides ~30% of their cost; a step that changes
    kind does not. The default policy's single exploring steps, and the steps after them, are
    all such steps, and its fit reads them as the cost of their depth (with these costs: 0.95x
    K=0 where K=0 is best at one request, 0.82x the best at 16 with cheap drafts). Exploring in
    bursts of 4 every 64 steps and fitting only pipelined steps keeps it near the best. (An
    experiment: not the default until measured on the H200.)"""
    overlap = 0.3
    costs = tuple(x / (1.0 - overlap) for x in costs)        # the steady costs as the other tests give them
    seeds = range(3)
    fixed = {k: sum(closed_loop(FixedDraftPolicy(k), costs, batch, uniform, s, alphas=alphas, overlap=overlap)
                    for s in seeds) for k in range(5)}
    auto = sum(closed_loop(_burst_policy(), costs, batch, uniform, s, alphas=alphas, overlap=overlap) for s in seeds)
    best = max(fixed, key=fixed.get)
    print(f"{costs} B={batch} overlap: bursts {auto / fixed[0]:.3f}x K=0, {auto / fixed[best]:.3f}x the best (K={best})")
    assert auto >= 0.95 * fixed[best] and auto >= 0.97 * fixed[0]


# ---- the timed step-cost table (engine/draft_calibration.py times it at start-up on CUDA) ------


def test_a_tables_drift_follows_live_decode_steps_that_ran_behind_another():
    table = StepCostTable({(1, 0): 1e-3, (1, 1): 2e-3, (8, 0): 2e-3, (8, 1): 4e-3})
    policy = AdaptiveDraftPolicy(1, cost_table=table)
    policy.observe_step(StepTiming(8, 16, 1, False, 6e-3, pipelined=True))
    policy.observe_step(StepTiming(8, 8, 0, False, 9e-3, pipelined=False))     # ran alone: not its cost
    policy.observe_step(StepTiming(8, 300, 0, True, 9e-3))                     # a prompt chunk
    assert table.drift == {1: pytest.approx(1.5)} and table.alone == {0: pytest.approx(4.5)}
    assert table.report()["live"] == {0: [1, 9.0], 1: [1, 6.0]}
    assert policy.fits == {}, "with a table the fits are not fed"
    assert policy.draft_cost() == pytest.approx(1.0), "the planner's cost: the table's at the latest batch"
    policy.forget_start_up()
    assert table.drift == {} == table.alone and policy.cost_table is table, "a reset forgets live steps, not the table"


class _TimedDepth(FixedDraftPolicy):
    """A fixed depth that keeps the seconds of its steps that ran behind another (what
    engine/draft_calibration.py keeps of the engine's)."""

    def __init__(self, k):
        super().__init__(k)
        self.times = []

    def observe_step(self, timing):
        if timing is not None and timing.pipelined is not False and timing.num_head_forwards == self._num_drafts:
            self.times.append(timing.seconds)


def timed_table(costs, uniform, overlap, sizes=(1, 2, 4, 8, 16, 32)):
    """The table of the simulated engine, timed as the engine's start-up times its own: each
    size at each fixed depth, the first two steps left out."""
    samples = {}
    for n in sizes:
        for d in range(5):
            policy = _TimedDepth(d)
            closed_loop(policy, costs, n, uniform, seed=99, num_tokens=48, overlap=overlap)
            samples[n, d] = policy.times[2:]
    return StepCostTable.from_samples(samples)


@pytest.mark.parametrize("costs,uniform,alphas", [(HOST_BOUND_GPU, True, MIXED_ALPHAS), (CHEAP_DRAFTS, True, MIXED_ALPHAS),
                                                  (COMPUTE_BOUND_CPU, False, MIXED_ALPHAS),
                                                  (MODERATE_DRAFTS, True, BUNDLED_ALPHAS),
                                                  (H200_DRAFTING_STEP, True, BUNDLED_ALPHAS)])
@pytest.mark.parametrize("overlap", [0.0, 0.3])
@pytest.mark.parametrize("batch", [1, 16])
def test_on_a_timed_table_auto_stays_near_the_best_fixed_k(costs, uniform, alphas, overlap, batch):
    """Judged by a table of every depth's timed cost, auto is near the best fixed K on every cost
    shape, the H200's fixed drafting cost and overlapped steps included, where the fit falls to
    0.73-0.76x the best (the strict xfail above). 16 requests at one a time, 64 at 16."""
    costs = tuple(x / (1.0 - overlap) for x in costs)
    seeds, num_requests = range(3), 16 if batch == 1 else 64
    fixed = {k: sum(closed_loop(FixedDraftPolicy(k), costs, batch, uniform, s, alphas=alphas, overlap=overlap,
                                num_requests=num_requests) for s in seeds) for k in range(5)}
    table = timed_table(costs, uniform, overlap)
    auto = sum(closed_loop(AdaptiveDraftPolicy(4, cost_table=table), costs, batch, uniform, s, alphas=alphas,
                           overlap=overlap, num_requests=num_requests) for s in seeds)
    best = max(fixed, key=fixed.get)
    print(f"{costs} B={batch} overlap {overlap}: table {auto / fixed[0]:.3f}x K=0, {auto / fixed[best]:.3f}x the best (K={best})")
    assert auto >= 0.955 * fixed[best] and auto >= 0.96 * fixed[0]


def test_on_a_table_a_step_at_k0_drafts_one_only_to_measure_acceptance():
    """Drafts dear enough that K=0 is best at the measured acceptance: a request of a small
    step without trials of its own is probed (one draft, every probe_interval-th step) until it
    has min_request_trials; a step of 16 is not (the replica's value stands for its requests),
    and nowhere is one probed where even acceptance 1 would not pay."""
    table = StepCostTable({(n, d): (1.0 + 0.8 * d) * 1e-3 * (1 + n / 16) for n in (1, 16) for d in range(5)})
    policy = AdaptiveDraftPolicy(4, cost_table=table, probe_interval=4, idle_explore_interval=0)
    policy.set_plan({}, prior=0.3)                     # a measured acceptance, low: K=0 is best
    one = [_request("one")]
    ks = []
    for _ in range(40):
        k = policy.step_drafts(one, uniform=True)[0]
        ks.append(k)
        if k:
            policy.observe_verified("one", k, 0)       # rejected: one trial
        policy.observe_step(None)
    assert [i + 1 for i, k in enumerate(ks) if k] == [4, 8, 12, 16], ks        # the step index counts from 1
    many = [_request(f"m{i}") for i in range(16)]
    assert all(policy.step_drafts(many, uniform=True) == [0] * 16 for _ in range(16))
    never = StepCostTable({(1, 0): 1e-3, (1, 1): 3e-3, (1, 2): 5e-3, (1, 3): 7e-3, (1, 4): 9e-3})
    policy = AdaptiveDraftPolicy(4, cost_table=never, probe_interval=1, idle_explore_interval=1)
    assert all(policy.step_drafts([_request(f"r{i}")], uniform=True) == [0] for i in range(8)), \
        "a draft costs two plain steps: not even acceptance 1 pays for one"


def test_on_a_table_acceptance_by_position_keeps_auto_off_deep_drafts_the_head_makes_badly():
    """An MTP head's chained drafts are kept less often the deeper they are (0.9x per position
    here). One acceptance for every position overrates the deep steps the H200's fixed
    drafting cost favours; by position, auto keeps near the best fixed K."""
    costs, decay = H200_DRAFTING_STEP, 0.9
    seeds = range(3)

    def loop(policy_for, s):
        return closed_loop(policy_for(), costs, 1, True, s, alphas=BUNDLED_ALPHAS, num_requests=16,
                           position_decay=decay)
    fixed = {k: sum(loop(lambda k=k: FixedDraftPolicy(k), s) for s in seeds) for k in range(5)}
    table = timed_table(costs, True, 0.0)

    def flat():
        policy = AdaptiveDraftPolicy(4, cost_table=table)
        policy.positions.relative = lambda: None       # one acceptance for every position
        return policy
    by_position = sum(loop(lambda: AdaptiveDraftPolicy(4, cost_table=table), s) for s in seeds)
    one = sum(loop(flat, s) for s in seeds)
    best = max(fixed.values())
    print(f"by position {by_position / best:.3f}x the best, one acceptance {one / best:.3f}x")
    assert by_position >= 0.94 * best and by_position > 1.03 * one


def test_on_a_table_the_price_of_joining_requests_keeps_auto_from_drafting_where_it_loses():
    """At 16 requests of 128 tokens each a request joins every few steps; on the H200 a joining
    request cost drafting steps ~1.4 ms more than steady ones (session z), enough to make K=0
    best where steady steps favour deep drafts. With the table's join prices and the measured
    rate of joining requests, auto keeps near the best fixed K; without them it drafts deep.
    (256 requests: its one step that measures acceptance at the start pays the first 16
    requests' joins, 7% of a run of 64.)"""
    costs, join = H200_DRAFTING_STEP, 1.4e-3
    seeds = range(3)

    def loop(policy, s):
        return closed_loop(policy, costs, 16, True, s, alphas=BUNDLED_ALPHAS, num_requests=256, join_cost=join)
    fixed = {k: sum(loop(FixedDraftPolicy(k), s) for s in seeds) for k in range(5)}
    timed = timed_table(costs, True, 0.0)
    priced = StepCostTable(timed.measured, {(n, d): join for n in timed.sizes for d in range(1, 5)})
    with_joins = sum(loop(AdaptiveDraftPolicy(4, cost_table=priced), s) for s in seeds)
    without = sum(loop(AdaptiveDraftPolicy(4, cost_table=timed), s) for s in seeds)
    best = max(fixed, key=fixed.get)
    print(f"joins priced {with_joins / fixed[best]:.3f}x the best (K={best}), not priced {without / fixed[best]:.3f}x; "
          + " ".join(f"K={k} {v / fixed[0]:.2f}" for k, v in fixed.items()))
    assert with_joins >= 0.96 * fixed[best] and with_joins >= 0.96 * fixed[0]
    assert without < 0.95 * fixed[best], "the join price made no difference: the test exercised nothing"
    rate = ArrivalRate(halflife_tokens=512, min_tokens=64)
    for _ in range(200):
        rate.observe(1, 128)                  # one request joins per 128 tokens
    assert rate.per_token == pytest.approx(1 / 128)
