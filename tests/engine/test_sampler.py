"""Sampler: parameter validation, logit processing (temperature, top-k, top-p), seeded sampling."""

import numpy as np
import pytest

from mtpserve.engine import sampler
from mtpserve.engine.sampler import SamplingParams, make_rng, probs, row_argmax, sample_from_probs


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_p=True), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(seed="7"), "seed"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop_token_ids=[2, -1]), "stop_token_ids"),
        (dict(stop_token_ids=2.5), "stop_token_ids"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_invalid_params_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_params_are_normalised():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=-3, stop="###", stop_token_ids=[1, 2])
    assert params.stop == ("###",) and params.stop_token_ids == (1, 2)
    assert SamplingParams(stop=None, stop_token_ids=7).stop_token_ids == (7,)
    assert params.processing_key == (0.7, 0, 0.9, 0.0)
    assert SamplingParams(temperature=0, top_k=5).processing_key == (0.0, 0, 1.0, 0.0)
    hash(params)  # frozen and hashable: usable as a grouping key
    make_rng(params.seed).random()  # negative seeds are accepted


def test_temperature_scales_logits_before_softmax():
    logits = np.array([[1.0, 2.0, 0.5, -1.0]], dtype=np.float32)
    expected = np.exp(logits[0] / 0.5) / np.exp(logits[0] / 0.5).sum()
    np.testing.assert_allclose(probs(logits, SamplingParams(temperature=0.5))[0], expected, rtol=1e-5)


def test_greedy_is_argmax_lowest_index_on_ties():
    logits = np.array([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]], dtype=np.float32)
    greedy = SamplingParams(temperature=0)
    assert row_argmax(logits).tolist() == [1, 0]
    np.testing.assert_array_equal(probs(logits, greedy), [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_top_k_keeps_exactly_k_with_ties_to_lower_ids():
    logits = np.array([[1.0, 3.0, 3.0, 3.0, 0.0]], dtype=np.float32)
    kept = probs(logits, SamplingParams(top_k=2))[0]
    np.testing.assert_allclose(kept, [0, 0.5, 0.5, 0, 0], atol=1e-7)


def test_top_p_keeps_smallest_nucleus_with_ties_to_lower_ids():
    logits = np.log(np.array([[0.4, 0.2, 0.2, 0.2], [0.1, 0.5, 0.3, 0.1]], dtype=np.float32))
    out = probs(logits, SamplingParams(top_p=0.5))
    np.testing.assert_allclose(out[0], [2 / 3, 1 / 3, 0, 0], rtol=1e-5)
    out = probs(logits, SamplingParams(top_p=0.45))
    np.testing.assert_allclose(out[1], [0, 1, 0, 0], atol=1e-7)
    out = probs(logits, SamplingParams(top_p=0.75))
    np.testing.assert_allclose(out[1], [0, 0.625, 0.375, 0], rtol=1e-5)


@pytest.mark.parametrize("vocab", [8, 64, 4096])      # the full sort (short and long rows), and the candidate shortcut
def test_top_p_boundary_a_token_is_kept_while_the_mass_before_it_is_below_top_p(vocab):
    """Equal logits give exact probabilities 1/vocab, so the mass before each token lands exactly
    on top_p: the token there is dropped (the nucleus is the smallest set reaching top_p)."""
    logits = np.zeros((1, vocab), dtype=np.float32)
    for top_p, num_kept in [(0.25, vocab // 4), (0.5, vocab // 2), (0.5 + 0.5 / vocab, vocab // 2 + 1)]:
        out = probs(logits, SamplingParams(top_p=top_p))[0]
        assert np.count_nonzero(out) == num_kept and out[:num_kept].all(), (top_p, np.count_nonzero(out))


def test_top_k_keeps_the_k_highest_with_ties_to_lower_ids_on_random_rows():
    rng = np.random.default_rng(11)
    logits = rng.integers(0, 6, size=(64, 40)).astype(np.float32)      # many ties
    for k in (1, 2, 3, 7, 20, 39):
        kept = probs(logits, SamplingParams(top_k=k)) > 0
        for row, keep in zip(logits, kept):
            order = sorted(range(len(row)), key=lambda i: (-row[i], i))
            assert set(np.flatnonzero(keep)) == set(order[:k]), (k, row)


def test_top_p_keeps_the_nucleus_with_ties_to_lower_ids_on_random_rows():
    rng = np.random.default_rng(12)
    logits = rng.integers(0, 4, size=(32, 300)).astype(np.float32)     # long rows, many ties
    for top_p in (0.1, 0.5, 0.9):
        kept = probs(logits, SamplingParams(top_p=top_p)) > 0
        for row, keep in zip(logits, kept):
            p = np.exp(row.astype(np.float64) - row.max())
            p /= p.sum()
            order = sorted(range(len(row)), key=lambda i: (-row[i], i))
            mass_before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
            assert set(np.flatnonzero(keep)) == {i for i, m in zip(order, mass_before) if m < top_p}, top_p


def test_probabilities_stay_finite_for_large_logits():
    logits = np.array([[90.0, 0.0, -90.0], [-200.0, -201.0, -250.0]], dtype=np.float32)
    out = probs(logits, SamplingParams(temperature=1.0))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out.sum(axis=1), 1, rtol=1e-6)
    assert out[0, 0] > 0.999 and out[1, 0] > out[1, 1] > out[1, 2]


def test_valid_edge_values_are_accepted():
    assert SamplingParams(max_tokens=1).max_tokens == 1
    assert SamplingParams(stop_token_ids=[0]).stop_token_ids == (0,)
    assert SamplingParams(top_p=1, temperature=0).is_greedy


def test_a_seed_is_taken_mod_2_to_the_64():
    assert make_rng(5 + 2**64).random() == make_rng(5).random()
    assert make_rng(-1).random() == make_rng(2**64 - 1).random()


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = np.log(np.array([[0.3, 0.3, 0.2, 0.1, 0.1]], dtype=np.float32))
    # top-2 renormalises to [0.5, 0.5]; top_p 0.4 then keeps only the first of the tie
    np.testing.assert_allclose(probs(logits, SamplingParams(top_k=2, top_p=0.4))[0], [1, 0, 0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(probs(logits, SamplingParams(top_k=3, top_p=0.7))[0], [0.5, 0.5, 0, 0, 0], rtol=1e-5)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_nucleus_candidate_shortcut_matches_full_sort(monkeypatch, top_p):
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(6, 400)) * np.array([[0.5], [1], [2], [4], [8], [16]])).astype(np.float32)
    logits[:, 7] = logits[:, 8]  # a tie somewhere
    params = SamplingParams(top_p=top_p)
    full = probs(logits, params)
    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", 16)
    np.testing.assert_array_equal(probs(logits, params), full)


def test_rows_with_different_params_match_rows_processed_alone():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)).astype(np.float32)
    row_params = [
        SamplingParams(top_k=5),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.6, temperature=0.8),
        SamplingParams(top_k=5),
        SamplingParams(),
    ]
    batched = probs(logits, row_params)
    for i, params in enumerate(row_params):
        np.testing.assert_array_equal(batched[i], probs(logits[i : i + 1], params)[0])


def test_sampled_frequencies_follow_processed_probs():
    logits = np.log(np.array([[0.35, 0.25, 0.2, 0.1, 0.05, 0.05]], dtype=np.float32))
    params = SamplingParams(top_k=4, temperature=1.0)
    num_trials = 20000
    ids = sample_from_probs(probs(np.repeat(logits, num_trials, axis=0), params), make_rng(11).random(num_trials))
    expected = probs(logits, params)[0]
    assert set(ids.tolist()) <= {0, 1, 2, 3}
    frequencies = np.bincount(ids, minlength=6) / num_trials
    assert 0.5 * np.abs(frequencies - expected).sum() < 0.02  # total variation; ~0.005 expected
    assert 0.5 * np.abs(frequencies - probs(logits, SamplingParams())[0]).sum() > 0.05


def test_inverse_cdf_never_picks_a_zero_probability_token():
    row = np.array([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]], dtype=np.float32)
    for u in [0.0, 0.4999, 0.5, np.nextafter(1.0, 0.0)]:
        assert sample_from_probs(row, [u])[0] in (1, 3)
    assert sample_from_probs(row, [np.nextafter(1.0, 0.0)])[0] == 3


def test_min_p_drops_tokens_less_likely_than_min_p_times_the_most_likely():
    logits = np.log(np.array([[0.5, 0.3, 0.12, 0.05, 0.03]], np.float32))
    p = probs(logits, SamplingParams(temperature=1.0, min_p=0.2))[0]     # threshold 0.1: keeps 0.5, 0.3, 0.12
    assert np.allclose(p, np.array([0.5, 0.3, 0.12, 0, 0]) / 0.92, atol=1e-6)
    assert np.allclose(probs(logits, SamplingParams(temperature=1.0, min_p=1.0))[0], [1, 0, 0, 0, 0])
    assert np.allclose(probs(logits, SamplingParams(temperature=1.0))[0], [0.5, 0.3, 0.12, 0.05, 0.03], atol=1e-6)


def test_penalties_follow_openais_and_ctrls_formulas():
    """Frequency and presence (OpenAI's): logit[j] -= count[j] * frequency + (count[j] > 0) *
    presence, over the output so far. Repetition (CTRL's, as vLLM and transformers apply it):
    every token seen in the prompt or the output has a positive logit divided by the penalty
    and a negative one multiplied by it, so both become less likely."""
    row = np.array([2.0, -2.0, 1.0, 0.5, 3.0], np.float32)
    got = sampler.apply_penalties(row.copy(), SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
                                  prompt_ids=[4], output_ids=[0, 0, 0, 3])
    np.testing.assert_allclose(got, [2.0 - 1.5 - 1.0, -2.0, 1.0, 0.5 - 0.5 - 1.0, 3.0])
    got = sampler.apply_penalties(row.copy(), SamplingParams(repetition_penalty=2.0), prompt_ids=[1], output_ids=[0])
    np.testing.assert_allclose(got, [1.0, -4.0, 1.0, 0.5, 3.0])
