"""Speculative decoding: draft proposal, verification (greedy and exact sampling), stats.

A speculative step feeds one request's rows ``[t, d0 .. dK-1]`` to the target model; target
row i predicts the token after input i, so it is checked against draft d_i, and the last row
gives the bonus token when every draft is accepted:

    input row     t     d0    d1   ...  dK-1
    target row    0     1     2    ...  K
    checks        d0    d1    d2   ...  bonus
    emitted       accepted drafts d0..d(j-1), then one token from row j   (j = num accepted)

So a step emits j + 1 tokens, 1 <= j + 1 <= K + 1. Array code takes an array module ``xp``
(numpy default; the runner passes cupy on the GPU); random numbers come from the request's
host ``numpy.random.Generator``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mtpserve.engine.sampler import SamplingParams, draw_tokens, per_row_rngs, probs, row_argmax, sample_from_probs, sample_keyed, to_host

# The most drafts one request may carry in one step: the paged export captures at most
# state_update_capacity transitions, and its CUDA kernels are built for at most 8 rows per request.
MAX_NUM_DRAFTS = 7


def accept_greedy(target_argmax: Sequence[int], draft_tokens: Sequence[int]) -> tuple[list[int], int]:
    """Greedy verification on host ids: target_argmax has K+1 entries, draft_tokens K.

    Accepts the longest prefix of drafts equal to the target argmax, then emits the target's
    token at the first mismatch (or the bonus token). Returns (emitted tokens, num accepted).
    """
    num_drafts = len(draft_tokens)
    assert len(target_argmax) == num_drafts + 1, f"{len(target_argmax)} target rows for {num_drafts} drafts"
    num_accepted = 0
    while num_accepted < num_drafts and int(draft_tokens[num_accepted]) == int(target_argmax[num_accepted]):
        num_accepted += 1
    emitted = [int(t) for t in draft_tokens[:num_accepted]] + [int(target_argmax[num_accepted])]
    return emitted, num_accepted


def _packed_offsets(num_drafts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """First target row and first draft row of each request in the packed layout.

    request r owns target rows  target_start[r] .. target_start[r] + K_r   (K_r + 1 rows)
                   draft rows   draft_start[r]  .. draft_start[r] + K_r - 1 (K_r rows)

        K = [2, 0, 1]   target rows  r0 r0 r0 | r1 | r2 r2    target_start = [0, 3, 4]
                        draft rows   r0 r0 | r2               draft_start  = [0, 2, 2]
    """
    counts = np.asarray(num_drafts, dtype=np.int64)
    draft_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    target_start = draft_start + np.arange(len(counts), dtype=np.int64)
    return target_start, draft_start


def verify_sampled_batch(
    target_probs,
    draft_probs,
    draft_tokens: Sequence[Sequence[int]],
    rngs: np.random.Generator | Sequence[np.random.Generator],
    xp=None,
) -> list[tuple[list[int], int]]:
    """Exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for many requests.

    target_probs [sum(K_r + 1), V]: each request's processed target probabilities p_0..p_K
    (after its temperature / top-k / top-p); draft_probs [sum(K_r), V]: the q_i each draft was
    sampled from, processed the same way; both packed by request (see ``_packed_offsets``).
    draft_tokens[r]: request r's drafts d_0..d_{K_r-1}; rngs[r]: its RNG (one Generator = all).

    Draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order. At the first
    rejection the emitted token is drawn from normalise(max(0, p_i - q_i)) (from p_i if that
    residual has no mass); after K acceptances the bonus token is drawn from p_K. The emitted
    tokens are then distributed exactly as tokens sampled from the target one by one.

    Each request draws K_r + 1 uniforms from its RNG (K_r acceptance tests, then the emitted
    token). Two device syncs for the whole batch. Returns [(emitted tokens, num accepted)].
    """
    xp = xp or np
    target_probs = xp.asarray(target_probs)
    draft_probs = xp.asarray(draft_probs)
    num_requests = len(draft_tokens)
    row_rngs = per_row_rngs(rngs, num_requests)
    num_drafts = [len(d) for d in draft_tokens]
    target_start, draft_start = _packed_offsets(num_drafts)
    assert target_probs.shape[0] == sum(num_drafts) + num_requests, "target rows != sum(K_r + 1)"
    assert draft_probs.shape[0] == sum(num_drafts), "draft rows != sum(K_r)"

    if num_requests == 0:
        return []
    tokens = np.concatenate([np.asarray(d, dtype=np.int64).reshape(-1) for d in draft_tokens])
    p_at_draft = q_at_draft = np.zeros(0)
    if tokens.size:
        draft_rows = xp.asarray(np.arange(tokens.size))
        target_rows = xp.asarray(np.arange(tokens.size) + np.repeat(np.arange(num_requests), num_drafts))
        cols = xp.asarray(tokens)
        at_draft = xp.stack([target_probs[target_rows, cols], draft_probs[draft_rows, cols]])
        p_at_draft, q_at_draft = to_host(at_draft).astype(np.float64)

    num_accepted = np.zeros(num_requests, dtype=np.int64)
    final_uniforms = np.empty(num_requests)
    for r, rng in enumerate(row_rngs):
        uniforms = rng.random(num_drafts[r] + 1)
        start, end = draft_start[r], draft_start[r] + num_drafts[r]
        # u < p/q, written without the division: q = 0 < p accepts, p = 0 rejects.
        rejected = np.flatnonzero(uniforms[:-1] * q_at_draft[start:end] >= p_at_draft[start:end])
        num_accepted[r] = rejected[0] if rejected.size else num_drafts[r]
        final_uniforms[r] = uniforms[-1]

    final_rows = target_probs[xp.asarray(target_start + num_accepted)]
    was_rejected = num_accepted < np.asarray(num_drafts, dtype=np.int64)
    if was_rejected.any():
        rejected_at = np.flatnonzero(was_rejected)
        p_rows = final_rows[xp.asarray(rejected_at)]
        q_rows = draft_probs[xp.asarray(draft_start[rejected_at] + num_accepted[rejected_at])]
        residual = xp.maximum(p_rows - q_rows, 0)
        has_mass = residual.sum(axis=1, keepdims=True) > 0
        final_rows[xp.asarray(rejected_at)] = xp.where(has_mass, residual, p_rows)
    final_tokens = sample_from_probs(final_rows, final_uniforms, xp)
    return [
        ([int(t) for t in draft_tokens[r][: num_accepted[r]]] + [int(final_tokens[r])], int(num_accepted[r]))
        for r in range(num_requests)
    ]


def warm_up_sampled(vocab_size: int, logits_dtype, xp, max_drafts: int = 2) -> None:
    """Run once, on made-up logits, every array arrangement the sampled paths use at one and at
    several rows: ``probs`` with each processing kind (temperature, top-k, top-p without top-k,
    both, min-p, rows of mixed kinds), both draws on the device and to the host, and
    ``verify_sampled_batch`` with rejections. CuPy builds a kernel with NVRTC on the first use of
    each (0.1 s; CUB's argmax 1.7 s), which the warm-up requests did not all reach: on the
    H100 a mixed greedy / top-p / seeded load built such kernels on live steps
    (``live_compiles.py``, session 24). On the CPU (numpy) there is nothing to build."""
    rng = np.random.default_rng(0)
    logits = xp.asarray(rng.standard_normal((max(3, max_drafts + 1) * 3, vocab_size)).astype(logits_dtype))
    kinds = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=50),
             SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
             SamplingParams(temperature=0.8, min_p=0.05)]
    for n in (1, 3):
        rows = logits[:n]
        for params in kinds:
            p = probs(rows, params, xp)
            for on_device in (True, False):
                sample_from_probs(p, rng.random(n), xp, on_device=on_device)
                sample_keyed(p, list(range(n)), [0] * n, xp, on_device=on_device)
        probs(rows, [SamplingParams(temperature=0), kinds[2], kinds[0]][:n], xp)      # rows of mixed kinds
        k = max_drafts
        target, q = probs(logits[:n * (k + 1)], kinds[2], xp), probs(logits[-n * k:], kinds[2], xp)
        q = xp.stack([q[i] for i in range(n * k)])        # (accept_step stacks each draft's q row)
        drafts = [to_host(row_argmax(q[i * k:(i + 1) * k], xp)).tolist() for i in range(n)]
        verify_sampled_batch(target, q, drafts, rng, xp)
        verify_sampled_batch(target, q, [[(t + 1) % vocab_size for t in d] for d in drafts], rng, xp)


@dataclass
class SpecDecodeStats:
    """Speculative-decoding counters; the same type serves one request and a whole engine.

    ``record_step`` is called once per target forward that emits tokens for a request (a step
    with no drafts counts as a forward with 0 drafts). An engine either records every request's
    steps into its own instance or folds finished requests in with ``merged``.
    Derived values are properties; with nothing recorded they are 0.0 (acceptance_length 1.0).
    """

    num_drafts: int = 0  # target forwards that carried >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_forwards: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: times draft i was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: times draft i was proposed

    def record_step(self, num_draft_tokens: int, num_accepted_tokens: int, num_emitted_tokens: int) -> None:
        """Count one target forward. num_emitted_tokens may be below accepted + 1 when a stop cut the step."""
        self.record_steps(((num_draft_tokens, num_accepted_tokens, num_emitted_tokens),))

    def record_steps(self, steps) -> None:
        """``record_step`` for each ``(drafts, accepted, emitted)`` of ``steps`` (one call for a
        whole engine step: it runs for every request of every step)."""
        drafted, accepted = self.drafted_per_position, self.accepted_per_position
        for d, a, e in steps:
            if not (0 <= a <= d and 1 <= e <= a + 1):
                raise AssertionError(f"emitted {e} with {a} accepted of {d} drafts")
            self.num_target_forwards += 1
            self.num_emitted_tokens += e
            if d:
                self.num_drafts += 1
                self.num_draft_tokens += d
                self.num_accepted_tokens += a
                if len(drafted) < d:
                    drafted.extend([0] * (d - len(drafted)))
                if len(accepted) < a:
                    accepted.extend([0] * (a - len(accepted)))
                for i in range(d):
                    drafted[i] += 1
                for i in range(a):
                    accepted[i] += 1

    def merged(self, other: SpecDecodeStats) -> SpecDecodeStats:
        """A new instance holding the sums of both."""
        out = SpecDecodeStats(
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            num_target_forwards=self.num_target_forwards + other.num_target_forwards,
            num_emitted_tokens=self.num_emitted_tokens + other.num_emitted_tokens,
        )
        for counts in (self.accepted_per_position, other.accepted_per_position):
            _add_counts(out.accepted_per_position, counts)
        for counts in (self.drafted_per_position, other.drafted_per_position):
            _add_counts(out.drafted_per_position, counts)
        return out

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts: mean tokens emitted by a step that carried drafts."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def tokens_per_target_forward(self) -> float:
        return self.num_emitted_tokens / self.num_target_forwards if self.num_target_forwards else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """[i]: accepted / proposed at draft position i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


def _add_counts(counts: list[int], other: list[int]) -> None:
    counts.extend([0] * (len(other) - len(counts)))
    for i, c in enumerate(other):
        counts[i] += c


def accept_step(scheduled: Sequence, target_rows: Sequence[int], drafts: dict, logits, xp=None,
                synthetic_acceptance: float | None = None,
                synthetic_rng: np.random.Generator | None = None) -> dict[str, tuple[list[int], int]]:
    """(emitted tokens, drafts accepted) of every scheduled request that samples this step.

    scheduled: the step's ``ScheduledRequest``s; target_rows[i]: the packed row of request i's
    newest real token (its K target rows follow it, see the module docstring); drafts: request
    id -> ``proposer.Drafts``. Greedy rows are checked on one host copy of the step's argmax.
    Sampled rows without drafts are sampled together. Sampled rows with drafts are verified
    together: a seeded request by coupling (target row j draws its token with the noise of
    output position n + j, the noise its draft j was drawn with, and drafts are kept while they
    equal those tokens: its tokens are then plain sampling's with its seed at any K, in any
    batch), any other by exact rejection sampling (``verify_sampled_batch``: more drafts kept).
    ``synthetic_acceptance`` (benchmarks only) accepts each greedy draft with that probability
    instead of checking it.
    """
    xp = xp or np
    argmax = None                                     # one device -> host copy, if any greedy row samples
    result: dict[str, tuple[list[int], int]] = {}
    plain, coupled, verified = [], [], []             # sampled requests: (scheduled, first target row)
    for s, last in zip(scheduled, target_rows):
        if not s.samples:
            continue
        r = s.request
        if not r.params.is_greedy:
            if not s.num_drafts:
                plain.append((s, last))
            else:
                (coupled if r.params.is_seeded_sampled else verified).append((s, last))
            continue
        if argmax is None:
            argmax = to_host(row_argmax(logits, xp)).tolist()
        if not s.num_drafts:
            result[r.request_id] = [argmax[last]], 0
            continue
        d = drafts[r.request_id].tokens
        emitted, num_accepted = accept_greedy(argmax[last:last + len(d) + 1], d)
        if synthetic_acceptance is not None:
            hits = synthetic_rng.random(len(d)) < synthetic_acceptance
            num_accepted = int(np.argmin(np.append(hits, False)))
            emitted = d[:num_accepted] + [int(argmax[last + num_accepted])]
        result[r.request_id] = emitted, num_accepted
    if plain:
        rows = xp.asarray(np.array([last for _, last in plain]))
        target = probs(logits[rows], [s.request.params for s, _ in plain], xp)
        tokens = draw_tokens(target, [s.request for s, _ in plain], [0] * len(plain), xp)
        result.update((s.request.request_id, ([int(t)], 0)) for (s, _), t in zip(plain, tokens))
    if coupled:
        rows = np.concatenate([np.arange(last, last + s.num_drafts + 1) for s, last in coupled])
        target = probs(logits[xp.asarray(rows)], [s.request.params for s, _ in coupled for _ in range(s.num_drafts + 1)],
                       xp)
        picks = draw_tokens(target, [s.request for s, _ in coupled for _ in range(s.num_drafts + 1)],
                            [j for s, _ in coupled for j in range(s.num_drafts + 1)], xp)
        start = 0
        for s, _ in coupled:
            n = s.num_drafts + 1
            result[s.request.request_id] = accept_greedy(picks[start:start + n], drafts[s.request.request_id].tokens)
            start += n
    if verified:
        rows = np.concatenate([np.arange(last, last + s.num_drafts + 1) for s, last in verified])
        params = [s.request.params for s, _ in verified for _ in range(s.num_drafts + 1)]
        target = probs(logits[xp.asarray(rows)], params, xp)
        q = xp.stack([qi for s, _ in verified for qi in drafts[s.request.request_id].q])
        outcomes = verify_sampled_batch(target, q, [drafts[s.request.request_id].tokens for s, _ in verified],
                                        [s.request.rng for s, _ in verified], xp)
        result.update((s.request.request_id, o) for (s, _), o in zip(verified, outcomes))
    return result
