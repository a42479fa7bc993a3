"""The step-cost models (``engine/step_costs.py``): the live fit recovers the costs it was fed,
keeps one-off stalls out but takes a lasting change, solves less often once settled, and equals
least squares updated every step; the timed table interpolates between its sizes and never
prices a deeper step below a shallower one."""
import math

import numpy as np
import pytest

from mtpserve.engine.draft_policy import best_depth
from mtpserve.engine.engine import StepTiming
from mtpserve.engine.step_costs import StepCostEstimator, StepCostTable


def feed(estimator, a, b, c, h=0.0, steps=200, seed=0):
    """Decode steps of random batch sizes and depths; a drafting step catches up on 1..3 rows
    per request (its last step's kept tokens), or 40 after a pause now and then."""
    import random
    rnd = random.Random(seed)
    for _ in range(steps):
        batch, k = rnd.randrange(1, 17), rnd.choice([0, 1, 2, 3])
        tokens = batch * (1 + k)
        head_rows = 0 if k == 0 else sum(40 if rnd.random() < 0.05 else rnd.randrange(1, 4) for _ in range(batch))
        estimator.observe(StepTiming(batch, tokens, k, False, a + b * tokens + c * k + h * head_rows,
                                     num_head_rows=head_rows))


def test_step_cost_estimator_recovers_the_cost_of_a_draft_level_and_of_the_heads_catch_up():
    est = StepCostEstimator(min_steps=10)
    assert est.draft_cost() is None                       # nothing seen yet
    feed(est, a=1e-3, b=3e-4, c=6e-4, h=5e-5)
    a, b, c, h = est.coefficients()
    assert (a, b, c, h) == pytest.approx((1e-3, 3e-4, 6e-4, 5e-5), rel=1e-3)
    batch = est._batch
    assert est.draft_cost() == pytest.approx((b * batch + c) / (a + b * batch), rel=1e-3)


def test_step_cost_estimator_needs_steps_with_different_draft_counts_and_skips_prefill():
    est = StepCostEstimator(min_steps=4)
    for _ in range(50):
        est.observe(StepTiming(8, 32, 3, False, 0.01))    # always K=3: head cost not separable
        est.observe(StepTiming(8, 400, 0, True, 0.5))     # prefill steps are another regime
    assert est.draft_cost() is None
    est.observe(StepTiming(8, 8, 0, False, 0.004))
    assert est.num_steps == 4 * est.min_steps, "the steps held for the first fit are bounded"
    assert est.draft_cost() is not None


def test_a_one_off_stall_stays_out_of_the_fit_but_a_lasting_change_gets_in():
    """A 0.4 s step among ~1 ms ones (the first burst's stall on the H200) once made every draft
    look as dear as a whole step for hundreds of steps; a cost that really changed is adopted."""
    est = StepCostEstimator(min_steps=10)
    feed(est, a=1e-3, b=3e-4, c=6e-4)
    before = est.draft_cost()
    est.observe(StepTiming(8, 24, 2, False, 0.4, num_head_rows=8))
    assert est.num_outliers == 1
    assert est.draft_cost() == pytest.approx(before, rel=1e-6)
    feed(est, a=1e-3, b=3e-4, c=6e-4, steps=20, seed=1)

    def predict():
        return float(np.dot(est.coefficients(), [1.0, 24, 2, 8]))
    old = predict()
    feed(est, a=1e-2, b=3e-3, c=6e-3, steps=50, seed=2)   # every step now costs 10x: the costs changed
    assert predict() > 2 * old, "a lasting change of the step costs must reach the fit"


def test_a_settled_fit_solves_less_often_until_its_costs_change():
    """A fit solves every 8 fitted steps for its first 256 (settling), then every 32; a lasting
    change of the costs (a run of outliers) makes it settle again, solving every 8."""
    est = StepCostEstimator(min_steps=10)
    feed(est, a=1e-3, b=3e-4, c=6e-4, steps=256, seed=0)
    settling = est.num_solves
    feed(est, a=1e-3, b=3e-4, c=6e-4, steps=320, seed=1)
    settled = est.num_solves - settling
    assert 28 <= settling <= 34 and 9 <= settled <= 11, (settling, settled)
    fitted = est.num_steps
    feed(est, a=1e-2, b=3e-3, c=6e-3, steps=160, seed=2)     # every step now costs 10x
    fitted, solves = est.num_steps - fitted, est.num_solves - settling - settled
    assert fitted >= 64 and solves >= fitted // 8 - 1, f"{solves} solves in {fitted} fitted steps after the change"


def test_the_fit_folded_in_batches_equals_the_fit_updated_every_step():
    """The estimator folds its fitted steps into the sums once per solve; its coefficients are
    those of exponentially weighted least squares updated at every step (the reference here)."""
    import random

    class EveryStep(StepCostEstimator):
        def _add(self, x, seconds, num_requests):
            super()._add(x, seconds, num_requests)
            *row, y = self._unfolded.pop()
            v = np.array(row)
            self._xx = self._decay * self._xx + np.outer(v, v)
            self._xy = self._decay * self._xy + v * y

    rnd = random.Random(3)
    folded, reference = StepCostEstimator(min_steps=10), EveryStep(min_steps=10)
    for i in range(400):
        batch, k = rnd.randrange(1, 17), rnd.choice([0, 1, 2, 3])
        rows = 0 if k == 0 else rnd.randrange(batch, 3 * batch)
        seconds = 1e-3 + 1e-5 * batch * (1 + k) + 2e-4 * k + 3e-6 * rows + rnd.random() * 1e-4
        for est in (folded, reference):
            est.observe(StepTiming(batch, batch * (1 + k), k, False, seconds, num_head_rows=rows))
        if i % 25 == 24 and folded.num_steps >= folded.min_steps:
            folded._solved = reference._solved = False          # both solve now: compare
            assert folded.coefficients() == pytest.approx(reference.coefficients(), rel=1e-6, abs=1e-12)
    assert folded.num_steps == reference.num_steps == 400 and folded.num_solves > 40


def test_a_fit_of_pipelined_steps_leaves_out_the_steps_that_ran_alone():
    """With overlapped decoding a step that changes kind runs alone and pays its launch and GPU
    time in full; ``pipelined_only`` fits only the others (and those of an engine without
    overlap, ``pipelined`` None), so a depth's cost is the one it has when held."""
    import random
    rnd = random.Random(0)
    true, mixed = StepCostEstimator(min_steps=10, pipelined_only=True), StepCostEstimator(min_steps=10)
    for i in range(300):
        batch, k = rnd.randrange(1, 17), rnd.choice([0, 1, 2, 3])
        alone = i % 5 == 0
        seconds = (1e-3 + 2e-5 * batch * (1 + k) + 3e-4 * k) * (1.8 if alone else 1.0)
        timing = StepTiming(batch, batch * (1 + k), k, False, seconds, pipelined=False if alone else (None if i % 2 else True))
        true.observe(timing)
        mixed.observe(timing)
    assert true.num_alone == 60 and mixed.num_alone == 0
    assert true.coefficients()[:3] == pytest.approx((1e-3, 2e-5, 3e-4), rel=1e-3)
    assert mixed.coefficients()[0] > 1.05e-3, "the steps run alone raise the fit of every step"


def test_a_timed_table_interpolates_between_sizes_and_never_prices_a_deeper_step_below():
    table = StepCostTable({(1, 0): 1.0, (1, 1): 2.0, (1, 2): 1.5,       # timing noise: d=2 below d=1
                           (4, 0): 2.0, (4, 1): 5.0, (4, 2): 6.0})
    assert table.step_seconds(1) == [1.0, 2.0, 2.0]
    assert table.step_seconds(2) == pytest.approx([1 + 1 / 3, 3.0, 2 + 4 / 3])
    assert table.step_seconds(8) == pytest.approx([2 + 4 / 3, 9.0, 6 + 16 / 3]), "past the largest: its last segment"
    seconds = table.seconds_at(4)
    assert [seconds(d, 99, 99, 99) for d in range(3)] == [2.0, 5.0, 6.0], "rows do not move a timed step"
    assert table.draft_cost(4) == pytest.approx((6.0 - 2.0) / (2 * 2.0))
    assert StepCostTable.from_samples({(1, 0): [1.0, 9.0, 2.0], (1, 1): [3.0]}).step_seconds(1) == [2.0, 3.0]
    # a step's token budget: 4 requests at depth 2 need 12 rows, 8 at depth 1 need 16
    capped = StepCostTable({(1, 0): 1.0, (1, 1): 2.0, (1, 2): 3.0, (4, 0): 2.0, (4, 1): 4.0, (4, 2): math.inf},
                           max_rows=12)
    assert capped.step_seconds(1) == [1.0, 2.0, 3.0], "a timed size is its own row, whatever the next one's"
    assert capped.step_seconds(2)[2] == math.inf, "between a size that runs a depth and one that cannot: infinite"
    assert capped.step_seconds(8) == [pytest.approx(10 / 3), math.inf, math.inf] and capped.draft_cost(8) is None
    assert best_depth([1.0] * 8, [4] * 8, capped.seconds_at(8), 2, uniform=True) == 0
    with pytest.raises(ValueError, match="every"):
        StepCostTable({(1, 0): 1.0, (1, 1): 2.0, (2, 0): 1.5})              # (2, 1) missing
    with pytest.raises(ValueError, match="positive"):
        StepCostTable({(1, 0): 0.0})
