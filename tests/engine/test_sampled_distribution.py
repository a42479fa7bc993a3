"""Sampled MTP decoding on the real engine emits tokens distributed as the target model says.

Sixteen unseeded requests of 64 tokens (their RNGs fixed by the test, so the run repeats) run
at once with K = 3, so every step after the prefill drafts three tokens: exact rejection
sampling (a seeded request is verified by coupling instead, whose tokens are plain sampling's:
tests/engine/test_engine.py); then the target's probabilities p at every output position are recomputed
from scratch (one main-model forward over prompt + output from zero states, processed with the
request's temperature / top-k / top-p). Given everything before it (the tokens, and where the
engine's steps began), each emitted token must be a draw from its p whatever the drafts were:
no token may have p = 0, the randomised PIT u = F(t-) + U p(t) (tokens ordered by p) is i.i.d.
Uniform(0, 1), and where a draft stood, a(t) = min(1, q(t) / p(t)) (q: that draft's distribution,
recorded from the engine) has conditional mean sum_v min(p_v, q_v). The last check has the power:
a wrong acceptance or rejection rule moves mass between the tokens where q > p and those where
q < p, which statistics of p alone hardly see. Every check has a false-alarm rate of 1e-3; each
wrong rule below fails one by far.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import mtpserve.engine.speculative as speculative_module
from mtpserve.engine.runner import PackedRows, Runner
from mtpserve.engine.sampler import SamplingParams, per_row_rngs, probs, sample_from_probs
from mtpserve.engine.speculative import SpecDecodeStats

from test_engine import PROMPTS, make_engine

K = 3
NUM_REQUESTS = 16
MAX_TOKENS = 64
PIT_BINS = 16
PIT_CRITICAL = 37.7        # chi-square(15) at 1e-3
Z_CRITICAL = 3.29          # |N(0, 1)| at 1e-3
FAR = 1.5                  # a wrong rule must fail its check by this factor: z 4.9, chi-square 57 (both ~1e-6)
PLAIN = "temperature-1.0"
FILTERED = "temperature-0.8-top-p-0.9"
MIN_P = "temperature-1.0-min-p-0.05"
SETTINGS = {PLAIN: {"temperature": 1.0}, FILTERED: {"temperature": 0.8, "top_p": 0.9},
            MIN_P: {"temperature": 1.0, "min_p": 0.05}}


# ---------------------------------------------------------------- wrong rules, on purpose
def _keep_by_ratio(u, p, q):
    return u * q < p


def _keep_by_p_ignoring_q(u, p, q):
    return u < p


def _residual(p, q):
    r = np.maximum(p - q, 0)
    return r if r.sum() > 0 else p


def _target(p, q):
    return p


def _verify_with(keeps, rejection_distribution):
    """A verify_sampled_batch keeping draft i while keeps(u, p_i(d_i), q_i(d_i)), drawing the token at
    the first rejection from rejection_distribution(p_i, q_i), and the bonus token from p_K."""
    def draw(dist, rng):
        return int(sample_from_probs(dist[None], [rng.random()])[0])

    def verify(target_probs, draft_probs, draft_tokens, rngs, xp=None):
        out, t, d = [], 0, 0
        for drafts, rng in zip(draft_tokens, per_row_rngs(rngs, len(draft_tokens))):
            drafts = [int(x) for x in drafts]
            p, q = np.asarray(target_probs[t:t + len(drafts) + 1]), np.asarray(draft_probs[d:d + len(drafts)])
            t, d = t + len(drafts) + 1, d + len(drafts)
            i = next((i for i, x in enumerate(drafts) if not keeps(rng.random(), p[i, x], q[i, x])), len(drafts))
            last = draw(rejection_distribution(p[i], q[i]) if i < len(drafts) else p[i], rng)
            out.append((drafts[:i] + [last], i))
        return out

    return verify


def accept_with_p_ignoring_q():
    """(a) Wrong: draft i kept with probability p_i(d_i), whatever q_i(d_i) was."""
    return "verify_sampled_batch", _verify_with(_keep_by_p_ignoring_q, _residual)


def resample_from_p_not_the_residual():
    """(b) Wrong: the right acceptance test, but a rejection draws from p_i, not max(0, p_i - q_i)."""
    return "verify_sampled_batch", _verify_with(_keep_by_ratio, _target)


def target_without_top_k_top_p():
    """(c) Wrong: the target side keeps the temperature but drops top-k / top-p (the drafts keep them)."""
    return "probs", lambda logits, params, xp=None: probs(
        logits, [dataclasses.replace(p, top_k=None, top_p=1.0) for p in params], xp)


def target_unprocessed():
    """(c') Wrong: the target side is the raw softmax, temperature and filters dropped."""
    return "probs", lambda logits, params, xp=None: probs(
        logits, [dataclasses.replace(p, temperature=1.0, top_k=None, top_p=1.0) for p in params], xp)


# ---------------------------------------------------------------- a run and its reference
@dataclasses.dataclass
class SampledRun:
    p: np.ndarray              # [N, V] reference target probabilities at every output position
    tokens: np.ndarray         # [N] the emitted tokens (request after request)
    q: np.ndarray              # [M, V] the draft distributions of the positions where a draft stood
    drafted: np.ndarray        # [M] those positions, as indices into p and tokens
    spec_stats: SpecDecodeStats


def sampled_run(model_dir, setting: str, max_tokens: int = MAX_TOKENS, seed_offset: int = 0,
                seeded: bool = False) -> SampledRun:
    """Run NUM_REQUESTS unseeded requests (RNGs seeded here) on PROMPTS[:4] at once, recording at
    which output position each verified draft's q stood, then recompute p at every output position."""
    # one prompt chunk per request (the forward counts below assume it): no prefix-cache boundary
    # cuts, whose extra chunk defers the others' drafts for a step
    engine = make_engine(model_dir, k=K, max_rows=NUM_REQUESTS, batch=NUM_REQUESTS, budget=512, prefix_cache=False)
    params = SamplingParams(**SETTINGS[setting], max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(f"r{i}", PROMPTS[i % 4], dataclasses.replace(params, seed=seed_offset + i)
                                   if seeded else params) for i in range(NUM_REQUESTS)]
    for i, r in enumerate(requests):
        r.rng = np.random.default_rng(seed_offset + i)
    proposed = []
    propose = engine.proposer.propose          # (a seeded request's drafts record q = None)

    def recording(drafting):
        drafting = list(drafting)
        drafts = propose(drafting)
        proposed.extend((s.request, s.request.num_output_tokens, drafts[s.request.request_id].q) for s in drafting)
        return drafts

    engine.proposer.propose = recording
    number = {r.request_id: i for i, r in enumerate(requests)}
    q_at = {}                                      # output position (request * max_tokens + j) -> q
    while engine.has_work:
        engine.step()
        for req, before, q in proposed:            # a draft stood at each emitted position but the bonus one
            for i in range(min(req.num_output_tokens - before, len(q))):
                q_at[number[req.request_id] * max_tokens + before + i] = q[i]
        proposed.clear()
    assert engine.is_idle_and_empty()
    assert all(r.num_output_tokens == max_tokens for r in requests)

    m = engine.manifest
    rows, first_block = [], 1
    for r in requests:
        num_blocks = -(-len(r.token_ids) // m.block_size)
        rows.append(PackedRows(r.token_ids, 0, list(range(first_block, first_block + num_blocks))))
        first_block += num_blocks
    runner = Runner(m, num_blocks=first_block, num_threads=2, with_head=False)
    zero = engine.state_bank.spec.zero_states(len(rows))
    logits = np.asarray(runner.run_main(rows, zero, np.zeros(len(rows), np.int32)).logits)
    ends = np.cumsum([len(r.token_ids) for r in requests])
    p = probs(logits[np.concatenate([np.arange(end - max_tokens - 1, end - 1) for end in ends])], params)
    tokens = np.concatenate([r.token_ids[r.num_prompt_tokens:] for r in requests])
    q = [v for v in q_at.values() if v is not None]
    return SampledRun(p, tokens, np.stack(q) if q else np.zeros((0, p.shape[1])), np.array(list(q_at)), engine.stats)


# ---------------------------------------------------------------- the statistics
def zero_probability_tokens(run: SampledRun) -> int:
    return int((run.p[np.arange(len(run.tokens)), run.tokens] == 0).sum())


def pit_chi_square(run: SampledRun) -> float:
    """Pearson chi-square of the randomised PIT values over PIT_BINS equal bins (PIT_BINS - 1 df)."""
    p, t = run.p, run.tokens
    at = p[np.arange(len(t)), t][:, None]
    ahead = (p > at) | ((p == at) & (np.arange(p.shape[1]) < t[:, None]))
    u = np.where(ahead, p, 0).sum(axis=1, dtype=np.float64) + np.random.default_rng(0).random(len(t)) * at[:, 0]
    counts = np.bincount(np.minimum((u * PIT_BINS).astype(int), PIT_BINS - 1), minlength=PIT_BINS)
    expected = len(t) / PIT_BINS
    return float(((counts - expected) ** 2 / expected).sum())


def acceptance_score_z(run: SampledRun) -> float:
    """z of sum over drafted positions of a(t) - E_p[a], a = min(1, q / p) (1 where q >= p)."""
    p, q = run.p[run.drafted].astype(np.float64), run.q.astype(np.float64)
    a = np.divide(q, p, out=np.ones_like(p), where=q < p)
    mean = (p * a).sum(axis=1)
    variance = (p * a * a).sum(axis=1) - mean ** 2
    emitted = a[np.arange(len(a)), run.tokens[run.drafted]]
    return float((emitted.sum() - mean.sum()) / math.sqrt(variance.sum()))


def statistics(run: SampledRun) -> dict:
    return {"zero_probability_tokens": zero_probability_tokens(run), "pit_chi_square": pit_chi_square(run),
            "acceptance_score_z": acceptance_score_z(run)}


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("setting", SETTINGS)
def test_sampled_mtp_tokens_are_distributed_as_the_target(model_dir, setting):
    """The checks pass on the engine as it is, with drafts at full depth behind every token but the first."""
    run = sampled_run(model_dir, setting)
    s = run.spec_stats
    assert s.num_target_forwards - s.num_drafts <= 2 * NUM_REQUESTS    # a request's first token (and last)
    assert s.drafted_per_position[K - 1] > 0.9 * s.num_drafts
    assert 0 < s.accepted_per_position[K - 1] and s.num_accepted_tokens < s.num_draft_tokens
    assert len(run.drafted) > 0.8 * NUM_REQUESTS * MAX_TOKENS
    stats = statistics(run)
    assert stats["zero_probability_tokens"] == 0, stats
    assert stats["pit_chi_square"] < PIT_CRITICAL, stats
    assert abs(stats["acceptance_score_z"]) < Z_CRITICAL, stats


@pytest.mark.parametrize("setting", [PLAIN, FILTERED])
def test_seeded_mtp_tokens_are_distributed_as_the_target(model_dir, setting):
    """Seeded requests are verified by coupling (their tokens are plain sampling's with keyed
    noise, tests/engine/test_engine.py): with drafts behind every token, each emitted token is
    still a draw from its p (no zero-probability token, uniform PIT)."""
    run = sampled_run(model_dir, setting, seeded=True)
    assert run.spec_stats.num_accepted_tokens > 0.3 * run.spec_stats.num_draft_tokens
    stats = {"zero_probability_tokens": zero_probability_tokens(run), "pit_chi_square": pit_chi_square(run)}
    assert stats["zero_probability_tokens"] == 0 and stats["pit_chi_square"] < PIT_CRITICAL, stats


@pytest.mark.parametrize("wrong_rule, setting, max_tokens, caught_by", [
    (accept_with_p_ignoring_q, PLAIN, MAX_TOKENS // 2, "acceptance_score_z"),
    (resample_from_p_not_the_residual, PLAIN, MAX_TOKENS, "acceptance_score_z"),
    (target_without_top_k_top_p, FILTERED, MAX_TOKENS // 2, "zero_probability_tokens"),
    (target_unprocessed, FILTERED, MAX_TOKENS // 2, "pit_chi_square"),
])
def test_the_checks_catch_a_wrong_rule_by_far(model_dir, monkeypatch, wrong_rule, setting, max_tokens, caught_by):
    """Each wrong rule fails its check by far; all but the subtlest, (b), already on half the tokens."""
    monkeypatch.setattr(speculative_module, *wrong_rule())
    stats = statistics(sampled_run(model_dir, setting, max_tokens))
    limit = {"zero_probability_tokens": 10, "pit_chi_square": FAR * PIT_CRITICAL,
             "acceptance_score_z": FAR * Z_CRITICAL}[caught_by]
    assert abs(stats[caught_by]) > limit, stats
