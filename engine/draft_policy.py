"""Draft policies: how many drafts each request carries in its next step.

``FixedDraftPolicy(K)`` is one K for everyone. ``AdaptiveDraftPolicy`` (``--draft-tokens auto``)
chooses each request's K from its measured acceptance and the replica's measured step cost; the
planner actor may override it per request. The engine reports to a policy as things happen:
``observe_verified(request_id, drafted, accepted)`` after each verified step of a request,
``observe_step(timing)`` after each step, ``forget(request_id)`` when a request ends.

Acceptance model: each draft is accepted with probability ``alpha`` given that the ones before
it were (prefix acceptance). A step with K drafts then emits on average

    E[tokens | K] = 1 + alpha + alpha^2 + ... + alpha^K

and costs ``1 + K * draft_cost`` plain decode steps. ``draft_cost`` is measured on each replica
(``StepCostEstimator``: a least-squares fit of step times against main-model rows and head
forwards, over decode steps; every 16th step drafts nothing so both regimes stay measured);
until it has enough steps a static guess stands in: ``0.15 * (1 + load)`` (``load`` = resident
requests / state rows, 1 when requests are queueing). The chosen K maximises tokens per unit
cost; ties go to the smaller K.

The estimator: a step that drafted K and had j accepted observed j successes in
``j + (1 if j < K else 0)`` trials (positions after the first rejection were never tried).
``AcceptanceEMA`` smooths that per request, weighting each step by its trials.

``AdaptiveDraftPolicy`` uses the planner actor's latest per-request K when it has one (on a
Serve replica), otherwise the same choice made locally from the request's EMA.
A request held at K = 0 still drafts one token every ``probe_interval`` steps so its EMA keeps
moving (otherwise a request once judged hopeless could never recover).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from mtpserve.engine.speculative import MAX_NUM_DRAFTS

# Until a replica has measured its step cost, a draft level is guessed to cost this much of a
# plain decode step (scaled up with load), and a new request's acceptance is guessed at PRIOR.
DEFAULT_DRAFT_COST = 0.15
PRIOR_ACCEPTANCE = 0.6


class DraftPolicy:
    """Chooses how many drafts a request carries in its next step, and hears how they did.

    ``num_drafts(request) -> int`` in 0..MAX_NUM_DRAFTS; 0 turns speculation off for that step.
    The scheduler still caps the answer by the capture capacity, the step's budget left and what
    the request may still emit. The ``observe_*`` / ``forget`` hooks do nothing here.
    """

    def num_drafts(self, request) -> int:
        raise NotImplementedError

    def step_num_drafts(self, wanted: list[int]) -> int:
        """One draft count for a whole step, from what its requests want (the scheduler asks when
        every request must carry the same number: captured verify steps): the median."""
        return sorted(wanted)[len(wanted) // 2]

    def observe_verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verified step of a request: ``num_accepted`` of its ``num_drafts`` drafts kept."""

    def observe_step(self, timing) -> None:
        """One engine step ran (an ``engine.StepTiming``)."""

    def reset_step_costs(self) -> None:
        """Forget the step times measured so far (the engine's start-up steps, which pay one-time
        costs no later step pays)."""

    def forget(self, request_id: str) -> None:
        """The request ended (finished, cancelled)."""


class FixedDraftPolicy(DraftPolicy):
    """The same draft count for every request and step; 0 = speculation off."""

    def __init__(self, num_drafts: int) -> None:
        if not isinstance(num_drafts, int) or isinstance(num_drafts, bool) or not 0 <= num_drafts <= MAX_NUM_DRAFTS:
            raise ValueError(f"num_drafts must be an integer in 0..{MAX_NUM_DRAFTS}, got {num_drafts!r}")
        self._num_drafts = num_drafts

    def num_drafts(self, request) -> int:
        return self._num_drafts

    def __repr__(self) -> str:
        return f"FixedDraftPolicy({self._num_drafts})"


@dataclass(frozen=True)
class DraftCostModel:
    """Cost of a step with K drafts, in units of a plain decode step.

    A static guess scales the per-draft cost with load; a measured one (``StepCostEstimator``)
    already saw the load in its step times, so ``scale_with_load`` is off for it.
    """
    draft_cost: float = DEFAULT_DRAFT_COST
    scale_with_load: bool = True

    def step_cost(self, num_drafts: int, load: float) -> float:
        scale = 1.0 + min(max(load, 0.0), 1.0) if self.scale_with_load else 1.0
        return 1.0 + num_drafts * self.draft_cost * scale


class StepCostEstimator:
    """The replica's measured step time, ``seconds ~ a + b * main_tokens + c * head_forwards``.

    Fitted by exponentially weighted least squares (a small ridge keeps it solvable) over decode
    steps (steps with a prompt chunk cost differently and are skipped). With B requests decoding,
    K drafts each add B main-model rows and K head forwards, so the marginal cost of one draft
    level relative to a plain decode step is ``(b*B + c) / (a + b*B)``: what ``draft_cost()``
    returns, or None until enough steps with different draft counts were seen.

    One-off stalls are left out of the fit: once it has coefficients, a step that took more than
    ``outlier_factor`` times its prediction (a garbage collection, a first call of some kernel,
    the host descheduled) is counted in ``num_outliers`` and skipped, unless it is the
    ``max_outliers_in_a_row``-th such step in a row: then the costs really changed, and it and
    the ones after it are fitted until a step is within the bound again. (Start-up steps that
    paid one-time costs had put a = 0.33 s into the fit on the H200, against ~1.5 ms steps, for
    hundreds of steps: every draft looked as dear as a whole step.)
    """

    def __init__(self, halflife_steps: float = 200.0, min_steps: int = 32,
                 outlier_factor: float = 4.0, max_outliers_in_a_row: int = 8):
        self._decay = 0.5 ** (1.0 / halflife_steps)
        self.min_steps = min_steps
        self.outlier_factor = outlier_factor
        self.max_outliers_in_a_row = max_outliers_in_a_row
        self.num_steps = 0
        self.num_outliers = 0
        self._outliers_in_a_row = 0
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self._batch = 0.0
        self._head_levels: set[int] = set()

    def observe(self, timing) -> None:
        """One engine step (an ``engine.StepTiming``)."""
        if timing is None or timing.has_prefill or timing.num_requests == 0:
            return
        x = np.array([1.0, timing.num_main_tokens, timing.num_head_forwards])
        coef = self.coefficients()
        if coef is not None and timing.seconds > self.outlier_factor * float(np.dot(coef, x)):
            self._outliers_in_a_row += 1
            if self._outliers_in_a_row < self.max_outliers_in_a_row:
                self.num_outliers += 1
                return
        else:
            self._outliers_in_a_row = 0
        self._xx = self._decay * self._xx + np.outer(x, x)
        self._xy = self._decay * self._xy + x * timing.seconds
        w = 0.0 if self.num_steps else 1.0
        w = max(w, 1.0 - self._decay)
        self._batch += w * (timing.num_requests - self._batch)
        self._head_levels.add(timing.num_head_forwards)
        self.num_steps += 1

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) in seconds, or None while the steps seen cannot separate them."""
        if self.num_steps < self.min_steps or len(self._head_levels) < 2:
            return None
        ridge = 1e-6 * max(self._xx[0, 0], 1.0) * np.eye(3)
        a, b, c = np.clip(np.linalg.solve(self._xx + ridge, self._xy), 0.0, None)
        return float(a), float(b), float(c)

    def draft_cost(self) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c = coef
        plain = a + b * self._batch
        return (b * self._batch + c) / plain if plain > 0.0 else None

    def cost_model(self, fallback: DraftCostModel) -> DraftCostModel:
        """The measured model when there is one, else ``fallback``."""
        d = self.draft_cost()
        return fallback if d is None else DraftCostModel(d, scale_with_load=False)


def expected_tokens(alpha: float, num_drafts: int) -> float:
    """Mean tokens one step emits with ``num_drafts`` drafts under prefix acceptance ``alpha``."""
    return sum(alpha ** i for i in range(num_drafts + 1))


def choose_num_drafts(alpha: float, load: float, max_drafts: int,
                      cost: DraftCostModel = DraftCostModel()) -> int:
    """The K in 0..max_drafts with the most expected tokens per unit of step cost."""
    best_k, best = 0, 1.0 / cost.step_cost(0, load)
    for k in range(1, max_drafts + 1):
        value = expected_tokens(alpha, k) / cost.step_cost(k, load)
        if value > best + 1e-9:
            best_k, best = k, value
    return best_k


class AcceptanceEMA:
    """Prefix-acceptance probability, exponentially smoothed over draft trials."""

    def __init__(self, prior: float = PRIOR_ACCEPTANCE, halflife_trials: float = 16.0):
        self.value = prior
        self.num_trials = 0
        self._decay = 0.5 ** (1.0 / halflife_trials)

    def observe_step(self, num_drafts: int, num_accepted: int) -> None:
        """One verified step: ``num_accepted`` of ``num_drafts`` drafts kept."""
        if num_drafts <= 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        weight = 1.0 - self._decay ** trials
        self.value += weight * (num_accepted / trials - self.value)
        self.num_trials += trials


@dataclass
class _Track:
    ema: AcceptanceEMA
    calls_at_zero: int = 0


class AdaptiveDraftPolicy(DraftPolicy):
    """Per-request K: the planner's plan when present, else a local choice from the EMA.

    ``num_drafts`` and the ``observe_*`` hooks run on the engine's owner thread; ``set_plan`` /
    ``set_load`` come from the worker's reporting thread (a dict swap each). ``max_drafts`` is
    the engine's cap (the model's capture capacity, at most MAX_NUM_DRAFTS).
    """

    def __init__(self, max_drafts: int, cost: DraftCostModel = DraftCostModel(),
                 prior: float = PRIOR_ACCEPTANCE, probe_interval: int = 8, explore_interval: int = 16):
        if not 0 <= max_drafts <= MAX_NUM_DRAFTS:
            raise ValueError(f"max_drafts must be in 0..{MAX_NUM_DRAFTS}, got {max_drafts}")
        self.max_drafts = max_drafts
        self.cost = cost
        self.prior = prior
        self.probe_interval = probe_interval
        self.load = 0.0
        self.estimator = StepCostEstimator()
        self.explore_interval = explore_interval
        self._step_index = 1                     # the step about to run, counted from 1
        self._step_cost = cost
        self._plan: dict[str, int] = {}
        self._tracks: dict[str, _Track] = {}
        self._lock = threading.Lock()

    # ---- from the planner (reporting thread) ---------------------------------------------
    def set_plan(self, num_drafts: dict[str, int], prior: float | None = None) -> None:
        self._plan = dict(num_drafts)
        if prior is not None:
            self.prior = prior

    def set_load(self, load: float) -> None:
        self.load = load

    # ---- the engine's hooks (owner thread) ------------------------------------------------
    def observe_step(self, timing) -> None:
        """Feed the step-cost model with what the step ran and how long it took (None: the
        step ran nothing); the next step's cost model is then the measured one, when it is ready."""
        self.estimator.observe(timing)
        self._step_index += 1
        self._step_cost = self.estimator.cost_model(self.cost)

    def reset_step_costs(self) -> None:
        self.estimator = StepCostEstimator()
        self._step_cost = self.cost
        self._step_index = 1

    def observe_verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self._track(request_id).ema.observe_step(num_drafts, num_accepted)

    def forget(self, request_id: str) -> None:
        """The request finished: drop its EMA."""
        with self._lock:
            self._tracks.pop(request_id, None)

    @property
    def exploring(self) -> bool:
        """Every explore_interval-th step drafts nothing, so step costs with and without drafts
        both keep being measured."""
        return self.explore_interval > 0 and self._step_index % self.explore_interval == 0

    def num_drafts(self, request) -> int:
        track = self._track(request.request_id)
        params = request.params
        if params.seed is not None and not params.is_greedy:
            # a seeded sampled request's tokens depend on its K: choose it from the request's own
            # history only (not load, timing or exploration), so the same seed gives the same text
            return self._probe(track, choose_num_drafts(track.ema.value, 0.0, self.max_drafts, self.cost))
        if self.exploring:
            return 0
        planned = self._plan.get(request.request_id)
        k = planned if planned is not None else choose_num_drafts(
            track.ema.value, self.load, self.max_drafts, self._step_cost)
        return self._probe(track, min(k, self.max_drafts))

    def step_num_drafts(self, wanted: list[int]) -> int:
        """The median of the requests' choices; a step whose median is 0 still drafts one token
        every probe_interval-th step (the per-request probe of a uniform step), so acceptance and
        the draft cost keep being measured, but never on an exploring step."""
        k = super().step_num_drafts(wanted)
        if k == 0 and self.max_drafts > 0 and not self.exploring and self._step_index % self.probe_interval == 0:
            return 1
        return k

    def _probe(self, track: _Track, k: int) -> int:
        """A request held at K = 0 still drafts one token every probe_interval steps."""
        if k == 0 and self.max_drafts > 0:
            track.calls_at_zero += 1
            if track.calls_at_zero % self.probe_interval == 0:
                return 1
        return k

    def _track(self, request_id: str) -> _Track:
        track = self._tracks.get(request_id)
        if track is None:
            with self._lock:
                track = self._tracks[request_id] = _Track(AcceptanceEMA(self.prior))
        return track

    def acceptance(self) -> dict[str, tuple[float, int]]:
        """{request id: (EMA of prefix acceptance, trials seen)} for the report to the planner."""
        with self._lock:
            return {rid: (t.ema.value, t.ema.num_trials) for rid, t in self._tracks.items()}
