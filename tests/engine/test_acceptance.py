"""The acceptance estimates (``engine/acceptance.py``): expected tokens count the bonus token,
the EMA counts only the positions a step tried, and acceptance by position counts each
position's trials."""
import pytest

from mtpserve.engine.acceptance import AcceptanceEMA, PositionAcceptance, expected_tokens


def test_expected_tokens_counts_the_bonus_token():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


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


def test_acceptance_by_position_counts_the_positions_each_step_tried():
    """A step with K drafts and j kept tried positions 1..min(j + 1, K); each position's rate
    over the rate of all trials is what a request's average acceptance is scaled by there."""
    positions = PositionAcceptance(4, min_trials=4)
    assert positions.relative() == [1.0] * 4
    for _ in range(10):
        positions.observe_step(3, 3)        # 1, 2, 3 kept
        positions.observe_step(3, 1)        # 1 kept, 2 rejected, 3 not tried
    assert positions.counts == [20, 20, 10, 0]
    rel = positions.relative()
    average = 40 / 50                       # 40 of 50 trials kept
    assert rel[0] == pytest.approx(1.0 / average, rel=0.02) and rel[1] == pytest.approx(0.5 / average, rel=0.02)
    assert rel[2] == pytest.approx(1.0 / average, rel=0.02) and rel[3] == 1.0, "position 4: never tried"
    positions.observe_step(0, 0)
    assert positions.counts == [20, 20, 10, 0]
