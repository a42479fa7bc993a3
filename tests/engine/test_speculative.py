"""Speculative decoding: greedy and exact-sampling verification, draft proposal, stats, draft policy.

The distribution tests model a target whose position-i distribution is a fixed p_i. One
verification step, completed by plain sampling from p_i at the positions it did not emit
(what the following steps would do), must produce sequences distributed as p_0 x p_1 x ...
"""

import math

import numpy as np
import pytest

from mtpserve.engine.sampler import SamplingParams, make_rng, position_noise, probs, sample_from_probs, sample_keyed
from mtpserve.engine.speculative import (
    SpecDecodeStats,
    accept_greedy,
    verify_sampled_batch,
)


def verify_greedy_batch(target_logits, draft_tokens):
    """Greedy verification of requests packed by request (K_r + 1 target rows each)."""
    argmax = np.asarray(target_logits).argmax(axis=1)
    starts = np.cumsum([0] + [len(d) + 1 for d in draft_tokens])
    return [accept_greedy(argmax[s:s + len(d) + 1], d) for s, d in zip(starts, draft_tokens)]


def verify_greedy(target_logits, draft_tokens):
    return verify_greedy_batch(target_logits, [draft_tokens])[0]


def verify_sampled(target_probs, draft_probs, draft_tokens, rng):
    return verify_sampled_batch(target_probs, draft_probs, [draft_tokens], [rng])[0]

VOCAB = 8
NUM_TRIALS = 20000


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.0902 is the 0.999 normal quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square_fits(counts, expected_probs) -> bool:
    """Pearson goodness of fit at alpha = 1e-3; cells expecting < 5 counts are pooled into one."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    expected = np.asarray(expected_probs, dtype=np.float64).ravel() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return False
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    observed, expected = observed[expected > 0], expected[expected > 0]
    if len(observed) < 2:  # a single cell: nothing left to compare
        return True
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat < chi_square_critical(len(observed) - 1)


@pytest.mark.parametrize(
    "target_argmax, drafts, emitted, num_accepted",
    [
        ([5, 6, 7, 9], [5, 6, 7], [5, 6, 7, 9], 3),  # all accepted: K + 1 tokens with the bonus
        ([4, 6, 7, 9], [5, 6, 7], [4], 0),  # first rejected: the target's token only
        ([5, 6, 2, 9], [5, 6, 7], [5, 6, 2], 2),  # rejected in the middle
        ([5, 1, 7, 9], [5, 6, 7], [5, 1], 1),  # later matches after a mismatch do not count
        ([3], [], [3], 0),  # no drafts
    ],
)
def test_accept_greedy(target_argmax, drafts, emitted, num_accepted):
    assert accept_greedy(target_argmax, drafts) == (emitted, num_accepted)


def test_verify_greedy_reads_the_argmax_of_each_target_row():
    logits = np.full((3, 10), -1.0, dtype=np.float32)
    logits[0, 4] = logits[1, 2] = logits[2, 8] = 1.0
    logits[1, 1] = 1.0  # a tie: the lower id wins
    assert verify_greedy(logits, [4, 1]) == ([4, 1, 8], 2)
    assert verify_greedy(logits, [4, 2]) == ([4, 1], 1)


def test_sampled_verification_of_greedy_distributions_equals_greedy_verification():
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0)
    for _ in range(50):
        target_logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
        drafts = rng.integers(0, VOCAB, size=3)
        num_matching = rng.integers(0, 4)
        drafts[:num_matching] = target_logits.argmax(axis=1)[:num_matching]
        q = probs(np.eye(VOCAB, dtype=np.float32)[drafts], greedy)
        assert verify_sampled(probs(target_logits, greedy), q, drafts, rng) == verify_greedy(target_logits, drafts)


def _verify_always_accept(target_probs, draft_probs, draft_tokens, rng):
    """Wrong on purpose: keeps every draft."""
    bonus = int(sample_from_probs(target_probs[-1:], [rng.random()])[0])
    return [int(t) for t in draft_tokens] + [bonus], len(draft_tokens)


def _verify_resample_from_target(target_probs, draft_probs, draft_tokens, rng):
    """Wrong on purpose: the right acceptance test, but a rejection resamples from p, not the residual."""
    for i, token in enumerate(draft_tokens):
        if rng.random() * draft_probs[i, token] >= target_probs[i, token]:
            resampled = int(sample_from_probs(target_probs[i : i + 1], [rng.random()])[0])
            return [int(t) for t in draft_tokens[:i]] + [resampled], i
    bonus = int(sample_from_probs(target_probs[-1:], [rng.random()])[0])
    return [int(t) for t in draft_tokens] + [bonus], len(draft_tokens)


def _per_request(verify_one):
    def verify_batch(target_probs, draft_probs, draft_tokens, rng):
        k = len(draft_tokens[0])
        return [
            verify_one(target_probs[r * (k + 1) : (r + 1) * (k + 1)], draft_probs[r * k : (r + 1) * k], d, rng)
            for r, d in enumerate(draft_tokens)
        ]

    return verify_batch


def _completed_sequences(verify_batch, num_drafts, params, seed):
    """Verify NUM_TRIALS requests with the same p, q; complete each to K + 1 tokens from p_i.

    Returns (sequences [NUM_TRIALS, K + 1], p [K + 1, V], q [K, V], emitted token lists).
    """
    rng = np.random.default_rng(seed)
    target_logits = (rng.normal(size=(num_drafts + 1, VOCAB)) * 1.5).astype(np.float32)
    draft_logits = target_logits[:num_drafts] + rng.normal(size=(num_drafts, VOCAB)).astype(np.float32)
    p = probs(target_logits, params)
    q_packed = probs(np.tile(draft_logits, (NUM_TRIALS, 1)), params)
    drafts = sample_from_probs(q_packed, rng.random(NUM_TRIALS * num_drafts)).reshape(NUM_TRIALS, num_drafts)
    results = verify_batch(np.tile(p, (NUM_TRIALS, 1)), q_packed, list(drafts), rng)
    fresh = sample_from_probs(np.tile(p, (NUM_TRIALS, 1)), rng.random(NUM_TRIALS * (num_drafts + 1)))
    sequences = fresh.reshape(NUM_TRIALS, num_drafts + 1)
    for trial, (emitted, num_accepted) in enumerate(results):
        assert len(emitted) == num_accepted + 1
        sequences[trial, : len(emitted)] = emitted
    return sequences, p, q_packed[:num_drafts], [emitted for emitted, _ in results]


def _matches_target(sequences, p) -> bool:
    """Joint of the first two positions ~ p_0 x p_1, and every position's marginal ~ p_i."""
    joint = np.bincount(sequences[:, 0] * VOCAB + sequences[:, 1], minlength=VOCAB * VOCAB)
    fits = [chi_square_fits(joint, np.outer(p[0], p[1]))]
    fits += [chi_square_fits(np.bincount(sequences[:, i], minlength=VOCAB), p[i]) for i in range(len(p))]
    return all(fits)


@pytest.mark.parametrize("num_drafts", [1, 2, 3])
def test_exact_speculative_sampling_preserves_the_target_distribution(num_drafts):
    sequences, p, q, emitted = _completed_sequences(verify_sampled_batch, num_drafts, SamplingParams(), seed=num_drafts)
    assert _matches_target(sequences, p)
    assert not _matches_target(sequences, np.vstack([q, p[-1:]]))  # drafts differ enough to notice


@pytest.mark.parametrize("wrong_verify", [_verify_always_accept, _verify_resample_from_target])
def test_the_distribution_check_catches_wrong_acceptance_rules(wrong_verify):
    sequences, p, _, _ = _completed_sequences(_per_request(wrong_verify), 2, SamplingParams(), seed=2)
    assert not _matches_target(sequences, p)


def test_with_top_k_and_top_p_emitted_tokens_stay_in_the_target_nucleus():
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.8)
    sequences, p, q, emitted = _completed_sequences(verify_sampled_batch, 2, params, seed=7)
    assert ((p > 0).sum(axis=1) < 5).all() and (q > 0).sum() < q.size  # the filters cut something
    for tokens in emitted:
        assert all(p[i, t] > 0 for i, t in enumerate(tokens))
    assert _matches_target(sequences, p)


def test_a_residual_without_mass_falls_back_to_the_target_row():
    p = np.array([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32)
    q = 2 * p[:1]  # q >= p everywhere (not a distribution): rejections leave no residual
    rng = make_rng(3)
    results = [verify_sampled(p, q, [0], rng) for _ in range(400)]
    rejected = [emitted[0] for emitted, num_accepted in results if num_accepted == 0]
    assert 100 < len(rejected) < 300 and set(rejected) <= {0, 1}


def test_verify_sampled_is_reproducible_from_the_seed():
    rng = np.random.default_rng(5)
    p = probs(rng.normal(size=(4, VOCAB)), SamplingParams())
    q = probs(rng.normal(size=(3, VOCAB)), SamplingParams())
    first = [verify_sampled(p, q, [1, 2, 3], r) for r in [make_rng(9)] for _ in range(30)]
    again = [verify_sampled(p, q, [1, 2, 3], r) for r in [make_rng(9)] for _ in range(30)]
    assert first == again


def test_batched_verification_equals_per_request_verification():
    rng = np.random.default_rng(6)
    num_drafts = [2, 0, 3, 1]
    target_logits = rng.normal(size=(sum(num_drafts) + 4, VOCAB)).astype(np.float32)
    p = probs(target_logits, SamplingParams(temperature=0.7))
    q = probs(rng.normal(size=(sum(num_drafts), VOCAB)), SamplingParams(temperature=0.7))
    drafts = [rng.integers(0, VOCAB, size=k) for k in num_drafts]
    target_at = np.cumsum([0] + [k + 1 for k in num_drafts])
    draft_at = np.cumsum([0] + num_drafts)
    for seed in range(20):
        batched = verify_sampled_batch(p, q, drafts, [make_rng(seed + r) for r in range(4)])
        alone = [
            verify_sampled(p[t0:t1], q[d0:d1], drafts[r], make_rng(seed + r))
            for r, (t0, t1, d0, d1) in enumerate(zip(target_at, target_at[1:], draft_at, draft_at[1:]))
        ]
        assert batched == alone
    greedy_batched = verify_greedy_batch(target_logits, drafts)
    bounds = zip(target_at, target_at[1:], drafts)
    assert greedy_batched == [verify_greedy(target_logits[t0:t1], d) for t0, t1, d in bounds]


def test_keyed_draws_follow_p_and_are_a_function_of_seed_and_position_alone():
    """A seeded request's draw (``sample_keyed``): over seeds, distributed as p (chi-square);
    for one seed, the same token in any batch and row order; new noise at every position and
    every seed; a one-hot row draws its token."""
    p = probs((np.random.default_rng(3).normal(size=(1, VOCAB)) * 1.5).astype(np.float32), SamplingParams())
    seeds = np.arange(NUM_TRIALS)
    tokens = sample_keyed(np.tile(p, (NUM_TRIALS, 1)), seeds, [5] * NUM_TRIALS)
    counts = np.bincount(tokens, minlength=VOCAB)
    expected = NUM_TRIALS * p[0]
    assert ((counts - expected) ** 2 / expected).sum() < chi_square_critical(VOCAB - 1)
    alone = [int(sample_keyed(p, [s], [5])[0]) for s in range(40)]
    assert tokens[:40].tolist() == alone
    assert sample_keyed(np.tile(p, (40, 1)), seeds[:40][::-1], [5] * 40).tolist() == alone[::-1]
    noise = position_noise([7, 7, 8], [0, 1, 0], VOCAB)
    assert not np.allclose(noise[0], noise[1]) and not np.allclose(noise[0], noise[2])
    assert np.allclose(noise[0], position_noise([7], [0], VOCAB)[0])
    assert sample_keyed(np.eye(VOCAB, dtype=np.float32)[[2, 6]], [1, 1], [0, 0]).tolist() == [2, 6]


def test_keyed_draws_of_two_close_distributions_agree_as_often_as_the_gumbel_coupling_allows():
    """The draft and the target of a seeded request draw with the same noise, and a draft is kept
    when it equals the target's draw: they agree with probability at least (1 - TV) / (1 + TV)
    (the Gumbel coupling), far more than independent draws would (sum p q)."""
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=(1, VOCAB)) * 1.5).astype(np.float32)
    p = probs(logits, SamplingParams())
    q = probs(logits + 0.5 * rng.normal(size=(1, VOCAB)).astype(np.float32), SamplingParams())
    seeds = np.arange(NUM_TRIALS)
    agree = (sample_keyed(np.tile(p, (NUM_TRIALS, 1)), seeds, [0] * NUM_TRIALS)
             == sample_keyed(np.tile(q, (NUM_TRIALS, 1)), seeds, [0] * NUM_TRIALS)).mean()
    tv = 0.5 * np.abs(p - q).sum()
    assert agree >= (1 - tv) / (1 + tv) - 0.02 and agree > float((p * q).sum()) + 0.2, (agree, tv)


def test_stats_count_steps_and_derive_rates():
    stats = SpecDecodeStats()
    stats.record_step(num_draft_tokens=0, num_accepted_tokens=0, num_emitted_tokens=1)  # prefill
    stats.record_step(num_draft_tokens=3, num_accepted_tokens=3, num_emitted_tokens=4)
    stats.record_step(num_draft_tokens=3, num_accepted_tokens=1, num_emitted_tokens=2)
    stats.record_step(num_draft_tokens=2, num_accepted_tokens=0, num_emitted_tokens=1)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert (stats.num_target_forwards, stats.num_emitted_tokens) == (4, 8)
    assert stats.accepted_per_position == [2, 1, 1]
    assert stats.drafted_per_position == [3, 3, 2]
    assert stats.acceptance_rate == pytest.approx(4 / 8)
    assert stats.acceptance_length == pytest.approx(1 + 4 / 3)
    assert stats.tokens_per_target_forward == pytest.approx(8 / 4)
    assert stats.acceptance_rate_per_position == pytest.approx([2 / 3, 1 / 3, 1 / 2])

    other = SpecDecodeStats()
    other.record_step(num_draft_tokens=5, num_accepted_tokens=5, num_emitted_tokens=6)
    total = stats.merged(other)
    assert total.accepted_per_position == [3, 2, 2, 1, 1] and total.num_draft_tokens == 13
    assert stats.num_draft_tokens == 8  # merged() returns a new object
    empty = SpecDecodeStats()
    assert (empty.acceptance_rate, empty.acceptance_length, empty.tokens_per_target_forward) == (0.0, 1.0, 0.0)
    with pytest.raises(AssertionError):
        stats.record_step(num_draft_tokens=2, num_accepted_tokens=3, num_emitted_tokens=4)
    with pytest.raises(AssertionError, match="emitted 3 with 1 accepted of 2 drafts"):
        stats.record_step(num_draft_tokens=2, num_accepted_tokens=1, num_emitted_tokens=3)
    for accepted, emitted in ((0, 2), (1, 1)):          # a step without drafts emits its one token
        with pytest.raises(AssertionError, match=f"emitted {emitted} with {accepted} accepted of 0 drafts"):
            stats.record_step(num_draft_tokens=0, num_accepted_tokens=accepted, num_emitted_tokens=emitted)


def test_merged_stats_sum_every_counter():
    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.record_step(3, 2, 3)
    a.record_step(0, 0, 1)
    b.record_step(2, 0, 1)
    b.record_step(3, 3, 4)
    m = a.merged(b)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_target_forwards", "num_emitted_tokens"):
        assert getattr(m, name) == getattr(a, name) + getattr(b, name), name
    assert m.accepted_per_position == [2, 2, 1] and m.drafted_per_position == [3, 3, 2]
    assert (a.num_drafts, a.num_target_forwards) == (1, 2), "merged() leaves its inputs alone"
