"""How often drafts are kept: the draft policy's acceptance estimates.

Prefix acceptance: each draft is accepted with probability ``alpha`` given that the ones before
it were; a step that drafted K and had j accepted observed j successes in ``j + (1 if j < K else
0)`` trials. ``AcceptanceEMA`` smooths that per request (and per replica), ``PositionAcceptance``
by draft position (an MTP head's deeper drafts are kept less often), ``ArrivalRate`` counts
requests joining the decoding batch per token (a timed table prices joins).
"""

from __future__ import annotations

import math

from mtpserve.engine.speculative import MAX_NUM_DRAFTS

# until a replica has measured acceptance, a new request's is guessed at this
PRIOR_ACCEPTANCE = 0.6


def expected_tokens(alpha: float, num_drafts: int) -> float:
    """Mean tokens one step emits with ``num_drafts`` drafts under prefix acceptance ``alpha``."""
    return sum(alpha ** i for i in range(num_drafts + 1))


class AcceptanceEMA:
    """Prefix-acceptance probability, exponentially smoothed over draft trials.

    The start value counts as ``prior_trials`` trials: until the trials seen outweigh it the
    estimate is their running mean beside it, then an exponential average. (Started as the
    average alone, a guessed 0.6 against true 0.93 was still read 0.77 after 16 trials; with
    the H200's fixed drafting cost that judged K=0 best where K=4 was, and a policy at K=0
    measures nothing more.)"""

    def __init__(self, prior: float = PRIOR_ACCEPTANCE, halflife_trials: float = 16.0,
                 prior_trials: float = float("inf")):
        self.value = prior
        self.num_trials = 0
        self.prior_trials = prior_trials
        self._decay = 0.5 ** (1.0 / halflife_trials)

    def observe_step(self, num_drafts: int, num_accepted: int) -> None:
        """One verified step: ``num_accepted`` of ``num_drafts`` drafts kept."""
        if num_drafts <= 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.num_trials += trials
        weight = 1.0 - self._decay ** trials
        if self.prior_trials != math.inf:      # (twice per request and step: the common case kept plain)
            weight = max(weight, trials / (self.num_trials + self.prior_trials))
        self.value += weight * (num_accepted / trials - self.value)


class ArrivalRate:
    """Requests that join the decoding batch per token emitted, exponentially weighted over
    tokens (half-life ``halflife_tokens``): 0 until ``min_tokens`` tokens were counted. A
    workload's property (1 / its mean output length, when requests run to their end), which
    a table's joins are priced by."""

    def __init__(self, halflife_tokens: float = 2048.0, min_tokens: int = 64):
        self._log_decay = math.log(0.5) / halflife_tokens
        self.min_tokens = min_tokens
        self.joins = 0.0
        self.tokens = 0.0
        self.num_tokens = 0

    def observe(self, joined: int, tokens: int) -> None:
        if tokens <= 0 and not joined:
            return
        decay = math.exp(self._log_decay * tokens)
        self.joins = decay * self.joins + joined
        self.tokens = decay * self.tokens + tokens
        self.num_tokens += tokens

    @property
    def per_token(self) -> float:
        return self.joins / self.tokens if self.num_tokens >= self.min_tokens and self.tokens > 0 else 0.0


class PositionAcceptance:
    """The replica's acceptance by draft position, relative to its average over positions.

    An MTP head's chained drafts are kept less often the deeper they are (bundled model on the
    H200 at one request: a single prefix acceptance fitted to K=2's steps is 0.87, to K=3's
    0.84, to K=4's 0.81, results/h200 session ax and z), so one acceptance for every position
    overrates deep steps. Each position keeps an exponentially weighted count of its trials and
    successes (a step with K drafts and j kept tried positions 1..min(j + 1, K); the trials of
    a step are weighted alike); ``relative``
    is each position's rate over the rate of all of them, 1 for a position with fewer than
    ``min_trials`` trials. A request's own estimate (an average over its positions) times a
    position's relative rate is then its rate there."""

    def __init__(self, max_positions: int = MAX_NUM_DRAFTS, halflife_trials: float = 256.0, min_trials: int = 16):
        self._decay = 0.5 ** (1.0 / halflife_trials)
        self.min_trials = min_trials
        self.successes = [0.0] * max_positions
        self.trials = [0.0] * max_positions
        self._counts = [0] * max_positions
        self._pending: dict[tuple[int, int], int] = {}    # (drafts, kept) -> verified steps not yet folded in

    def observe_step(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verified step (per request and step: only counted here, folded in when
        read; a fold per request cost ~2.5 us, 40 us a step at 16 requests on a 2-core host)."""
        if num_drafts > 0:
            key = (min(num_drafts, len(self.trials)), num_accepted)
            self._pending[key] = self._pending.get(key, 0) + 1

    def _fold(self) -> None:
        if not self._pending:
            return
        tried, kept = [0] * len(self.trials), [0] * len(self.trials)
        for (k, j), c in self._pending.items():
            for i in range(min(j + 1, k)):
                tried[i] += c
                kept[i] += c if i < j else 0
        self._pending.clear()
        for i, c in enumerate(tried):
            if c:
                decay = self._decay ** c
                self.trials[i] = decay * self.trials[i] + c
                self.successes[i] = decay * self.successes[i] + kept[i]
                self._counts[i] += c

    @property
    def counts(self) -> list[int]:
        """Trials seen at each position."""
        self._fold()
        return self._counts

    def relative(self) -> list[float]:
        """Per position 1..max, its acceptance over the average of every trial (1 until measured)."""
        self._fold()
        total = sum(self.trials)
        if not total:
            return [1.0] * len(self.trials)
        average = sum(self.successes) / total
        return [self.successes[i] / self.trials[i] / average
                if self._counts[i] >= self.min_trials and average > 0 else 1.0 for i in range(len(self.trials))]
