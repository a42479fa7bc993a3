"""Sampling: request parameters, per-request RNG, logit processing and token selection.

Array code is written against an array module ``xp`` (numpy by default, cupy on the GPU,
passed in by the runner); this module never imports cupy. Random numbers always come from
the request's own ``numpy.random.Generator`` on the host (one uniform per sampled row), and
only those uniforms go to the device, so a request's tokens depend on its seed and its
logits, not on which other requests share the batch or on the array module. A seeded
request draws instead with noise keyed by (seed, output position) (``sample_keyed``): the same
token at any draft count (``draw_tokens`` picks the way per request).

Processing order for a row (the order Hugging Face and vLLM use):

    logits / temperature -> keep top-k -> keep nucleus (top-p) -> softmax over kept tokens

Ties are broken towards the lower token id everywhere (greedy argmax, the k-th place of
top-k, the nucleus boundary), so the kept set is a function of the logits alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from mtpserve.engine import launches
from mtpserve.engine.grammar import GrammarSpec

# Below this temperature a request is sampled greedily (logits / 1e-6 overflow float32).
MIN_TEMPERATURE = 1e-5
# Top-p without top-k first looks for the nucleus among this many highest-logit tokens.
NUCLEUS_CANDIDATES = 1024


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_tuple(value, name: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be a value or a list of values, got {value!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. Invalid values raise ``ValueError`` (an HTTP 400).

    temperature: 0 (or below ``MIN_TEMPERATURE``) = greedy argmax.
    top_p: nucleus mass in (0, 1]; 1 = off.
    top_k: number of highest-logit tokens kept; 0 or None = off.
    min_p: in [0, 1]: tokens less likely than min_p x the most likely one are dropped (after
    temperature, before top-k and top-p); 0 = off.
    logit_bias: (token id, bias in [-100, 100]) pairs added to those logits (greedy too), like
    the penalties before everything else.
    seed: seeds the request's RNG; None = a fresh random seed. Any int (taken mod 2**64).
    max_tokens: number of tokens to generate, >= 1.
    stop: stop strings; stop_token_ids: stop token ids (a single value or None is accepted).
    ignore_eos: keep generating past the end-of-sequence token.
    presence_penalty / frequency_penalty (OpenAI's, in [-2, 2]): subtracted from the logit of
    every token already in the output, once / per occurrence; repetition_penalty (vLLM's, > 0,
    1 = off): the logit of every token in the prompt or the output divided by it when positive,
    multiplied when negative. All apply before temperature, top-k and top-p, to plain decoding
    and to each verify row with that row's own history (drafts accepted before it included).
    min_tokens: the stop ids (EOS included) cannot be emitted before this many tokens (their
    logits are masked, in plain decoding and in every verify row alike); stop strings still apply.
    include_stop_str_in_output: a stop string that ends the request stays in its text.
    prompt_logprobs: likewise for the prompt's tokens (from the second on; the request then starts
    from scratch, not from the prefix cache, since cached positions have no logits).
    logprobs: None = off; k in 0..MAX_LOGPROBS = each emitted token's log-probability and the k
    most likely tokens' at its position, from the model's raw distribution (log-softmax of the
    logits, before temperature, top-k and top-p: vLLM's default "raw_logprobs").
    grammar: structured output (``grammar.GrammarSpec``): every token outside the grammar is
    masked in every row (plain, draft and verify rows alike); the output ends with a stop id
    once the grammar is complete. It cannot be combined with ignore_eos or min_tokens (both
    forbid the stop id that a complete grammar allows alone).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        self.validate()

    def validate(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float, np.floating)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float, np.floating)) or isinstance(p, bool) or not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 or null disables it), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or null, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"stop_token_ids must hold integers >= 0, got {tok!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        m = self.min_p
        if not isinstance(m, (int, float, np.floating)) or isinstance(m, bool) or not 0 <= m <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")
        for pair in self.logit_bias:
            if (not isinstance(pair, tuple) or len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0
                    or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float)) or not -100 <= pair[1] <= 100):
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {pair!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float, np.floating)) or isinstance(v, bool) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float, np.floating)) or isinstance(r, bool) or not (0 < r <= 10):
            raise ValueError(f"repetition_penalty must be in (0, 10] (1 = off), got {r!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a boolean, got {self.include_stop_str_in_output!r}")
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured output: a complete grammar "
                                 "allows only the end of the output")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured output: a grammar complete "
                                 "before min_tokens would allow no token")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in 0..{MAX_LOGPROBS} or null, got {v!r}")

    # (the three flags below are read for each request on every step: worked out once; a frozen
    # dataclass still takes cached_property, which writes the instance's __dict__ directly)
    @cached_property
    def has_penalties(self) -> bool:
        """Logit changes that depend on the request (its history, its bias): see apply_penalties."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @cached_property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @cached_property
    def is_seeded_sampled(self) -> bool:
        """Sampled with a seed: output token n is drawn with the noise of (seed, n) however it is
        drafted and verified (``sample_keyed``, ``speculative.accept_step``), so its text is
        plain sampling's with that seed at any K, in any batch."""
        return self.seed is not None and not self.is_greedy

    @property
    def processing_key(self) -> tuple[float, int, float, float]:
        """(temperature, top_k, top_p, min_p) with 'off' values normalised; rows sharing it are processed together."""
        if self.is_greedy:
            return (0.0, 0, 1.0, 0.0)
        return (float(self.temperature), int(self.top_k or 0), float(self.top_p), float(self.min_p))


MAX_LOGPROBS = 20


def apply_penalties(row, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int], xp=None):
    """One row of logits ([V], modified in place) after ``params``' penalties, for a position
    whose output so far is ``output_ids`` (see SamplingParams)."""
    xp = xp or np
    if params.presence_penalty or params.frequency_penalty:
        ids, counts = np.unique(np.asarray(output_ids, np.int64), return_counts=True)
        if ids.size:
            d_ids = xp.asarray(ids)
            row[d_ids] -= xp.asarray((params.presence_penalty + params.frequency_penalty * counts).astype(np.float32)
                                     ).astype(row.dtype)
    if params.repetition_penalty != 1.0:
        seen = xp.asarray(np.unique(np.asarray(list(prompt_ids) + list(output_ids), np.int64)))
        vals = row[seen]
        row[seen] = xp.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if params.logit_bias:
        ids = xp.asarray(np.asarray([t for t, _ in params.logit_bias], np.int64))
        row[ids] += xp.asarray(np.asarray([b for _, b in params.logit_bias], np.float32)).astype(row.dtype)
    return row


def token_logprobs(logits, rows: Sequence[int], token_ids: Sequence[int], num_top: int, xp=None) -> list:
    """For each (row, token): (token, its log-probability, [(token, log-probability)] of the
    row's ``num_top`` most likely tokens, most likely first), from the raw log-softmax of
    ``logits[row]``; one device -> host copy."""
    xp = xp or np
    x = logits[xp.asarray(np.asarray(rows, np.int64))].astype(xp.float32)
    x = x - x.max(axis=1, keepdims=True)
    lp = x - xp.log(xp.exp(x).sum(axis=1, keepdims=True))
    chosen = lp[xp.arange(len(rows)), xp.asarray(np.asarray(token_ids, np.int64))]
    if num_top:
        top = xp.argsort(-lp, axis=1)[:, :num_top]
        top_lp = xp.take_along_axis(lp, top, axis=1)
        top, top_lp = to_host(top), to_host(top_lp)
    chosen = to_host(chosen)
    return [(int(t), float(chosen[i]),
             [(int(a), float(b)) for a, b in zip(top[i], top_lp[i])] if num_top else [])
            for i, t in enumerate(token_ids)]


def make_rng(seed: int | None) -> np.random.Generator:
    """The request's own RNG: seeded from ``seed`` (mod 2**64), or from OS entropy when None."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(int(seed) % 2**64)


def row_argmax(logits, xp=np, rows: Sequence[int] | None = None):
    """int64: each row's argmax (of rows ``rows`` only, in their order, when given), lowest id on
    ties (on a GPU one kernel, ``cuda_kernels.argmax_rows``, with no CuPy indexing)."""
    if xp is np or logits.ndim != 2 or not logits.flags.c_contiguous or logits.dtype not in (np.float16, np.float32):
        return (logits if rows is None else logits[xp.asarray(np.asarray(rows, np.int64))]).argmax(axis=1)
    from mtpserve.engine.cuda_kernels import argmax_rows
    if rows is None:
        return argmax_rows(logits)
    rows = np.asarray(rows, np.int64)
    if (rows == np.arange(len(rows))).all():
        return argmax_rows(logits, num_rows=len(rows))
    return argmax_rows(logits, rows=xp.asarray(rows))


def to_host(array) -> np.ndarray:
    """A numpy copy of a numpy or cupy array (cupy arrays have ``.get()``; a deferred step's
    launches are queued first: ``launches.escape``)."""
    if hasattr(array, "get"):
        launches.escape()
        return array.get()
    return np.asarray(array)


def _rows_params(params: SamplingParams | Sequence[SamplingParams], num_rows: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * num_rows
    params = list(params)
    assert len(params) == num_rows, f"{len(params)} params for {num_rows} rows"
    return params


def _group_rows(row_params: list[SamplingParams]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(row_params):
        groups.setdefault(p.processing_key, []).append(i)
    return groups


def _softmax(x, xp):
    x = x - x.max(axis=1, keepdims=True)
    e = xp.exp(x)
    return e / e.sum(axis=1, keepdims=True)


def _one_hot_argmax(x, xp):
    out = xp.zeros(x.shape, dtype=xp.float32)
    out[xp.arange(x.shape[0]), x.argmax(axis=1)] = 1.0
    return out


def _top_k_indices(x, k: int, xp):
    """[N, k] column indices of each row's k largest values, ascending; ties go to lower indices."""
    n = x.shape[0]
    kth = -xp.partition(-x, k - 1, axis=1)[:, k - 1 : k]
    above = x > kth
    at_kth = x == kth
    num_at_kth_kept = k - above.sum(axis=1, keepdims=True)
    keep = above | (at_kth & (xp.cumsum(at_kth, axis=1) <= num_at_kth_kept))
    return xp.nonzero(keep)[1].reshape(n, k)


def _mask_outside_nucleus(x, x_probs, top_p: float, xp):
    """Set to -inf every column of x outside the smallest highest-prob set with mass >= top_p.

    x_probs are the columns' probabilities under the distribution the nucleus is taken from.
    Columns are ordered by value, ties by column position (a stable sort), and a column is
    kept when the mass strictly before it is still < top_p:

        sorted probs  0.5  0.3  0.1  0.1      top_p = 0.8
        mass before   0.0  0.5  0.8  0.9  ->  keep, keep, drop, drop
    """
    order = xp.argsort(-x, axis=1, kind="stable")
    sorted_probs = xp.take_along_axis(x_probs, order, axis=1)
    cumulative = xp.cumsum(sorted_probs, axis=1)
    mass_before = xp.concatenate([xp.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], axis=1)
    keep = xp.zeros(x.shape, dtype=bool)
    keep[xp.arange(x.shape[0])[:, None], order] = mass_before < top_p
    return xp.where(keep, x, -xp.inf)


def _nucleus_candidates(x, top_p: float, xp):
    """Columns [N, NUCLEUS_CANDIDATES] holding every row's nucleus, with their probabilities, or None.

    The nucleus is a prefix of the value order, so it lies inside the top-m columns whenever
    their mass reaches top_p: then only m columns need sorting instead of the vocabulary.
    """
    cols = _top_k_indices(x, NUCLEUS_CANDIDATES, xp)
    row_max = x.max(axis=1, keepdims=True)
    total = xp.exp(x - row_max).sum(axis=1, keepdims=True)
    cand_probs = xp.exp(xp.take_along_axis(x, cols, axis=1) - row_max) / total
    if bool((cand_probs.sum(axis=1) >= top_p).all()):
        return cols, cand_probs
    return None


def _process(logits, temperature: float, top_k: int, top_p: float, min_p: float, xp):
    """Probabilities [N, V] float32 of rows that share one processing key."""
    if temperature == 0.0:
        return _one_hot_argmax(logits, xp)
    x = logits.astype(xp.float32) / xp.float32(temperature)
    if min_p > 0:         # relative to each row's most likely token, which always stays
        p = _softmax(x, xp)
        x = xp.where(p < xp.float32(min_p) * p.max(axis=1, keepdims=True), -xp.inf, x)
    vocab = x.shape[1]
    found = None
    if 0 < top_k < vocab:
        cols = _top_k_indices(x, top_k, xp)
        found = cols, None
    elif top_p < 1.0 and vocab > NUCLEUS_CANDIDATES:
        found = _nucleus_candidates(x, top_p, xp)
    if found is None:
        return _softmax(_mask_outside_nucleus(x, _softmax(x, xp), top_p, xp) if top_p < 1.0 else x, xp)
    cols, cand_probs = found
    kept = xp.take_along_axis(x, cols, axis=1)
    if top_p < 1.0:
        kept = _mask_outside_nucleus(kept, _softmax(kept, xp) if cand_probs is None else cand_probs, top_p, xp)
    x = xp.full(x.shape, -xp.inf, dtype=xp.float32)
    x[xp.arange(x.shape[0])[:, None], cols] = kept
    return _softmax(x, xp)


def probs(logits, params: SamplingParams | Sequence[SamplingParams], xp=None):
    """Processed probabilities [N, V] float32 of logits [N, V], one ``SamplingParams`` per row.

    Greedy rows come back one-hot at the argmax. Rows are grouped by ``processing_key`` and
    each group is processed in one vectorised pass.
    """
    xp = xp or np
    logits = xp.asarray(logits)
    assert logits.ndim == 2, f"logits must be [N, V], got shape {logits.shape}"
    num_rows = logits.shape[0]
    groups = _group_rows(_rows_params(params, num_rows))
    if len(groups) == 1:
        return _process(logits, *next(iter(groups)), xp)
    out = xp.empty(logits.shape, dtype=xp.float32)
    for key, rows in groups.items():
        index = xp.asarray(rows)
        out[index] = _process(logits[index], *key, xp)
    return out


def per_row_rngs(rngs: np.random.Generator | Sequence[np.random.Generator], num_rows: int) -> list:
    """One RNG per row: a single Generator serves every row in turn, else one each (checked)."""
    if isinstance(rngs, np.random.Generator):
        return [rngs] * num_rows
    rngs = list(rngs)
    assert len(rngs) == num_rows, f"{len(rngs)} RNGs for {num_rows} rows"
    return rngs


def sample_from_probs(probs_rows, uniforms, xp=None, on_device: bool = False) -> np.ndarray:
    """Inverse-CDF sampling: token ids (host int64 [N]; an xp array with ``on_device``, nothing
    waiting for the device) of probs [N, V] at uniforms [N] in [0, 1).

    Row i picks the first token whose cumulative mass exceeds ``uniforms[i] * total``;
    zero-probability tokens can never be picked.
    """
    xp = xp or np
    cdf = xp.cumsum(xp.asarray(probs_rows), axis=1)
    u = xp.asarray(np.asarray(uniforms, dtype=np.float64).reshape(-1, 1), dtype=cdf.dtype)
    ids = (cdf <= u * cdf[:, -1:]).sum(axis=1).astype(np.int64)
    if on_device:         # u * total rounded up to total: the last token with mass, for every row
        last = cdf.shape[1] - 1 - (xp.asarray(probs_rows)[:, ::-1] > 0).argmax(axis=1)
        return xp.where(ids >= cdf.shape[1], last, ids).astype(np.int64)
    ids = to_host(ids)
    overshoot = ids >= cdf.shape[1]
    if overshoot.any():  # u * total rounded up to total: take the last token with mass
        positive = to_host(xp.asarray(probs_rows)[np.flatnonzero(overshoot)] > 0)
        ids[overshoot] = positive.shape[1] - 1 - positive[:, ::-1].argmax(axis=1)
    return ids


# SplitMix64's constants: the golden-ratio increment and the finaliser's multipliers.
_GOLDEN, _MIX1, _MIX2, _TOKEN = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD1B54A32D192ED03


def _mix64(z, xp):
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic in numpy and cupy alike)."""
    z = (z ^ (z >> xp.uint64(30))) * xp.uint64(_MIX1)
    z = (z ^ (z >> xp.uint64(27))) * xp.uint64(_MIX2)
    return z ^ (z >> xp.uint64(31))


def position_noise(seeds: Sequence[int], positions: Sequence[int], vocab_size: int, xp=None):
    """Exponential(1) noise [N, V] float64, a pure function of (seed, output position, token id):
    row i's noise for ``seeds[i]`` at ``positions[i]``. The same on every array module."""
    xp = xp or np
    rows = xp.asarray(np.array([(int(s) % 2**64) for s in seeds], np.uint64))
    at = xp.asarray(np.asarray(positions, np.uint64))
    key = _mix64(_mix64(rows + xp.uint64(_GOLDEN), xp) + at * xp.uint64(_GOLDEN), xp)
    tokens = (xp.arange(1, vocab_size + 1, dtype=xp.uint64) * xp.uint64(_TOKEN))[None, :]
    h = _mix64(key[:, None] + tokens, xp)
    u = ((h >> xp.uint64(11)).astype(xp.float64) + 0.5) * (1.0 / 2**53)      # in (0, 1)
    return -xp.log(u)


def sample_keyed(probs_rows, seeds: Sequence[int], positions: Sequence[int], xp=None,
                 on_device: bool = False) -> np.ndarray:
    """Token ids (host int64 [N]) of probs [N, V]: row i takes argmax_v p(v) / E_v with E the
    ``position_noise`` of (seeds[i], positions[i]) (the exponential race, the Gumbel-max trick:
    a draw from p, zero-probability tokens never). Two distributions drawn at the same (seed,
    position) pick the same token as often as the Gumbel coupling allows: what lets a seeded
    request's draft be checked by equality with the target's own draw."""
    xp = xp or np
    p = xp.asarray(probs_rows)
    noise = position_noise(seeds, positions, p.shape[1], xp)
    ids = (p.astype(xp.float64) / noise).argmax(axis=1).astype(np.int64)
    return ids if on_device else to_host(ids)


def draw_tokens(probs_rows, requests: Sequence, offsets: Sequence[int], xp=None, on_device: bool = False) -> np.ndarray:
    """One token (host int64 [N]; an xp array with ``on_device``, nothing waiting for the device)
    from each row of processed probs [N, V]: row i is request i's output position n + offsets[i]
    (n: its output tokens so far). A seeded request draws with the noise of (its seed, that
    position) (``sample_keyed``: the same token whoever draws it, at any draft count); any other
    at its RNG's next uniform (``sample_from_probs``, inverse CDF)."""
    xp = xp or np
    seeded = [i for i, r in enumerate(requests) if r.params.is_seeded_sampled]
    rest = [i for i, r in enumerate(requests) if not r.params.is_seeded_sampled]
    out = (xp if on_device else np).empty(len(requests), np.int64)

    def rows(index: list[int]):
        return probs_rows if len(index) == len(requests) else probs_rows[xp.asarray(np.array(index))]

    def put(index: list[int], ids) -> None:
        if len(index) == len(requests):
            out[...] = ids
        else:
            out[xp.asarray(np.array(index)) if on_device else index] = ids
    if seeded:
        put(seeded, sample_keyed(rows(seeded), [requests[i].params.seed for i in seeded],
                                 [requests[i].num_output_tokens + offsets[i] for i in seeded], xp, on_device))
    if rest:
        put(rest, sample_from_probs(rows(rest), [requests[i].rng.random() for i in rest], xp, on_device))
    return out
