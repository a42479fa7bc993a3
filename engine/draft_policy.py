"""Draft policies: how many drafts each request carries in its next step.

``FixedDraftPolicy(K)`` is one K for everyone. ``AdaptiveDraftPolicy`` (``--draft-tokens auto``)
chooses each step's draft depth from its requests' measured acceptance and the replica's
measured step cost; the planner actor may cap it per request. The engine reports to a policy as
things happen: ``observe_verified(request_id, drafted, accepted)`` after each verified step of a
request, ``observe_step(timing)`` after each step, ``forget(request_id)`` when a request ends.

Acceptance model: each draft is accepted with probability ``alpha`` given that the ones before
it were (prefix acceptance). A request carrying K drafts then emits on average

    E[tokens | K] = 1 + alpha + alpha^2 + ... + alpha^K

The step's cost is measured on each replica (``step_costs.StepCostEstimator``: a least-squares fit of decode
step times, ``seconds ~ a + b * main_rows + c * head_forwards + h * head_catch_up_rows``). The
head's forwards are paid once per step for everyone (one forward per draft level), so the choice
is made per step: the depth D in 0..max with the most expected tokens, summed over the step's
requests, per predicted second (``best_depth``; each request carries min(D, its cap); one D for
all under uniform steps). Each batch-size class (1, 2-3, 4-7, ... requests: ``batch_class``)
has a fit of its own. Until a class's fit exists (its first ``min_steps`` decode steps) its steps
alternate D = 0 and 1, which is what the fit needs and never costs much, unless the nearest
fitted class says no depth pays for the step: then they stay at 0 (a drafting step there would
make the head catch up on every position since each request last drafted: as a batch shrank
through classes, those steps had auto at 0.79x-0.90x K=0 at C=16 on a 2-core CPU). A fit's
"no depth pays" is taken only on measured acceptance (the replica's ``min_prior_trials`` trials,
or the planner's cluster-wide value): judged on the guessed prior, the steps keep calibrating
until the trials are in (else a replica where drafting pays moderately stopped drafting on the
guess and never measured it). A static
guess of the cost can cost a lot (the old policy's deep start on one where drafts are dear). Every
``explore_interval``-th step takes a neighbouring depth (below and above by turns), so the fit
keeps seeing more than one depth. While the best depth is 0, only every
``idle_explore_interval``-th step (1024) drafts (one token), so acceptance keeps being measured,
slowly: a request that drafts again makes the head catch up on every position since it last
drafted, its prompt included (on a 2-core CPU at C=16, with one such step every 128, a round of
``bench --rounds`` had auto at 0.85x K=0 while it drafted on 3 of 252 steps).

The estimator: a step that drafted K and had j accepted observed j successes in
``j + (1 if j < K else 0)`` trials (positions after the first rejection were never tried).
``acceptance.AcceptanceEMA`` smooths that per request, weighting each step by its trials; a new request
starts from the replica's own running acceptance (every request's trials), or the planner's
cluster-wide prior until the replica has measured some.

With ``--draft-calibration on`` the engine times every batch size's and depth's step at start-up
(``step_costs.StepCostTable``, ``engine/draft_calibration.py``) and the policy judges by that table instead
of the fits: no depth is explored for its cost (on the H200 the fits, a line in the draft levels
seeing one or two depths at a time, had two stable states at 16 requests), only acceptance is
learned live, and by draft position (``PositionAcceptance``: an MTP head's deeper drafts are
kept less often), with the rate of requests joining the batch (``ArrivalRate``), which the
table's join prices are paid at. Opt-in until measured on the H200 against the fits.

On a Serve replica the planner actor sends a per-request K (its plan from the same reports);
the policy takes it as that request's cap. Every decoding request follows the step's depth,
seeded sampled ones too: their tokens do not depend on K (``speculative.accept_step``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from mtpserve.engine.acceptance import PRIOR_ACCEPTANCE, AcceptanceEMA, ArrivalRate, PositionAcceptance, expected_tokens
from mtpserve.engine.speculative import MAX_NUM_DRAFTS
from mtpserve.engine.step_costs import StepCostEstimator, StepCostTable, batch_class

_request_id = attrgetter("request_id")

# Until a replica has measured its step cost, a draft level is guessed to cost this much of a
# plain decode step (scaled up with load).
DEFAULT_DRAFT_COST = 0.15


class DraftPolicy:
    """Chooses how many drafts a step's requests carry, and hears how they did.

    ``step_drafts(requests, uniform)`` gives the counts (each in 0..MAX_NUM_DRAFTS; 0 turns
    speculation off) of a step's decoding requests, one for all under ``uniform`` (captured
    verify steps): what the scheduler asks. A policy that chooses per request gives
    ``num_drafts(request)`` instead, which the default ``step_drafts`` asks for each. The scheduler still caps
    the answers by the capture capacity, the step's budget left and what each request may still
    emit. The ``observe_*`` / ``forget`` hooks do nothing here.
    """

    def num_drafts(self, request) -> int:
        raise NotImplementedError

    def step_drafts(self, requests: list, uniform: bool) -> list[int]:
        """The draft counts of a step's decoding requests: each request's own, or under
        ``uniform`` their median for all."""
        wanted = [self.num_drafts(r) for r in requests]
        if uniform and wanted:
            return [sorted(wanted)[len(wanted) // 2]] * len(wanted)
        return wanted

    def observe_verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verified step of a request: ``num_accepted`` of its ``num_drafts`` drafts kept."""

    def observe_step(self, timing) -> None:
        """One engine step ran (an ``engine.StepTiming``)."""

    def forget_start_up(self) -> None:
        """Forget what the engine's start-up steps taught: their times (they pay one-time costs
        no later step pays) and their drafts' acceptance (their prompts are made up, not the
        workload's)."""

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

    def step_drafts(self, requests: list, uniform: bool) -> list[int]:
        return [self._num_drafts] * len(requests)

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


def choose_num_drafts(alpha: float, load: float, max_drafts: int,
                      cost: DraftCostModel = DraftCostModel()) -> int:
    """The K in 0..max_drafts with the most expected tokens per unit of step cost."""
    best_k, best = 0, 1.0 / cost.step_cost(0, load)
    for k in range(1, max_drafts + 1):
        value = expected_tokens(alpha, k) / cost.step_cost(k, load)
        if value > best + 1e-9:
            best_k, best = k, value
    return best_k


def best_depth(alphas, caps, seconds, max_depth: int, uniform: bool, profile=None) -> int:
    """The step's draft depth D in 0..max_depth with the most expected tokens per second.

    ``alphas``, ``caps``: each request's prefix acceptance and the most drafts it may carry;
    each carries min(D, cap), or D under ``uniform``. ``seconds(depth, main_rows, head_rows,
    expected_tokens)``: the step's predicted time (``seconds_at`` of a ``StepCostEstimator`` or a
    ``StepCostTable``); a drafting request's head catch-up rows at a steady depth are the
    tokens it kept in its last step, its expected tokens. Ties go to the smaller D.
    ``profile``: per draft position d = 1..max_depth, how a request's acceptance there compares
    with its average (``PositionAcceptance.relative``: an MTP head's chained drafts are kept less
    often the deeper they are); position d is then kept with probability min(1, alpha *
    profile[d-1]) given the ones before it. None: every position at alpha.

    Sums by depth (this runs on the host, beside ~0.5 ms GPU steps: ~15 us at 16 requests on a
    2-core host; ``step_drafts`` asks again only when the step's acceptances, caps or costs
    changed): with cnt[d] requests allowed d drafts and P[d] their sum of alpha^d, a step
    at depth D has n + sum_{d<=D} cnt[d] main rows and n + sum_{d<=D} P[d] expected tokens. A
    step's predicted seconds never fall as D grows (a fit's extrapolation past the depths it saw
    can make them, and then the deepest step looked free)."""
    n = len(alphas)
    if n > 24 and max_depth > 0:                     # many requests: the sums in numpy
        al = np.clip(np.asarray(alphas, dtype=np.float64), 0.0, 1.0)
        if profile is None:
            powers = np.cumprod(np.broadcast_to(al, (max_depth, n)), axis=0)      # [d-1, i] = alpha_i^d
        else:
            rel = np.asarray(profile[:max_depth], dtype=np.float64)[:, None]
            powers = np.cumprod(np.minimum(al[None, :] * rel, 1.0), axis=0)
        if uniform:
            power, count = [0.0, *powers.sum(axis=1).tolist()], [0] + [n] * max_depth
        else:
            allowed = np.arange(1, max_depth + 1)[:, None] <= np.asarray(caps)[None, :]
            power = [0.0, *np.where(allowed, powers, 0.0).sum(axis=1).tolist()]
            count = [0, *allowed.sum(axis=1).tolist()]
    else:
        power = [0.0] * (max_depth + 1)
        count = [0] * (max_depth + 1)
        for alpha, cap in zip(alphas, caps):
            top = max_depth if uniform else min(cap, max_depth)
            p = 1.0
            alpha = 0.0 if alpha < 0.0 else 1.0 if alpha > 1.0 else alpha    # (no builtin calls: ~100 a step)
            for d in range(1, top + 1):
                if profile is None:
                    p *= alpha
                else:
                    r = alpha * profile[d - 1]
                    p *= r if r < 1.0 else 1.0
                power[d] += p
                count[d] += 1
    step = max(seconds(0, n, 0.0, float(n)), 1e-9)
    best, best_value = 0, n / step
    rows, tokens = n, float(n)
    for d in range(1, max_depth + 1):
        rows += count[d]
        tokens += power[d]
        head_rows = tokens - (n - count[1])          # the requests that draft at all catch up
        # a deeper step never costs less: a fit extrapolated past the depths it saw can say so
        step = max(seconds(d, rows, head_rows, tokens), step)
        if tokens / step > best_value * (1.0 + 1e-9):
            best, best_value = d, tokens / step
    return best


class AdaptiveDraftPolicy(DraftPolicy):
    """Per-step draft depth from measured acceptance and step cost; see the module docstring.

    ``step_drafts`` and the ``observe_*`` hooks run on the engine's owner
    thread; ``set_plan`` comes from the worker's reporting thread (a dict swap). ``max_drafts``
    is the engine's cap (the model's capture capacity, at most MAX_NUM_DRAFTS).
    """

    def __init__(self, max_drafts: int,
                 prior: float = PRIOR_ACCEPTANCE, explore_interval: int = 16,
                 idle_explore_interval: int = 1024, min_prior_trials: int = 16, min_request_trials: int = 4,
                 probe_interval: int = 32,
                 explore_burst: int = 1, fit_pipelined_only: bool = False,
                 cost_table: StepCostTable | None = None, calibration_burst: int | None = None):
        """explore_burst: an exploring (or calibrating) depth is held for this many steps in a
        row; with fit_pipelined_only (the fits leave out steps an overlapping engine ran alone)
        only a burst's later steps are measured, at the cost its depth has when held. Both are
        off by default: an experiment for the H200, where auto has two stable states at 16
        requests (README, "A known gap"), not yet measured there. calibration_burst: the same
        for the calibrating steps alone (depths 0 and 1 by turns while a batch-size class has no
        fit; default ``explore_burst``): an engine that overlaps its steps stops its pipeline at
        each change of depth, so calibrating by single steps stops it every other step (such an
        engine holds them ``engine.CALIBRATION_BURST`` steps). cost_table: the replica's
        timed step costs (``set_cost_table``); min_request_trials, probe_interval: how a policy
        on a table measures the acceptance of requests it does not draft for
        (``_table_depth``)."""
        if not 0 <= max_drafts <= MAX_NUM_DRAFTS:
            raise ValueError(f"max_drafts must be in 0..{MAX_NUM_DRAFTS}, got {max_drafts}")
        self.max_drafts = max_drafts
        self.prior = prior                        # the planner's cluster-wide value replaces it
        self._prior_measured = False              # True once the planner sent its measured prior
        self.explore_interval = explore_interval
        self.idle_explore_interval = idle_explore_interval
        self.min_prior_trials = min_prior_trials
        self.min_request_trials = min_request_trials
        self.probe_interval = probe_interval
        if explore_burst < 1 or (explore_interval and explore_burst >= explore_interval):
            raise ValueError(f"explore_burst must be in 1..explore_interval - 1, got {explore_burst}")
        self.explore_burst = explore_burst
        if calibration_burst is not None and calibration_burst < 1:
            raise ValueError(f"calibration_burst must be >= 1, got {calibration_burst}")
        self.calibration_burst = explore_burst if calibration_burst is None else calibration_burst
        self.fit_pipelined_only = fit_pipelined_only
        self.cost_table = None                    # timed at start-up: judges every depth when set
        self._batch = 1                           # the latest step's requests (the planner's draft cost)
        self.fits: dict[int, StepCostEstimator] = {}   # batch-size class -> its step-cost fit
        self._fit_by_size: dict[int, StepCostEstimator] = {}   # requests in a step -> its class's fit
        # (fits change only through fit_for and forget_start_up, which keep the two in step)
        self._last_fit: StepCostEstimator | None = None
        self.replica_acceptance = AcceptanceEMA(prior, halflife_trials=64.0)
        self.positions = PositionAcceptance(max(1, max_drafts))
        self.arrivals = ArrivalRate()
        self._arrivals_per_token = 0.0            # the rate the depths are judged on (refreshed now and then)
        self._joined = self._accepted = 0         # since the last observed step
        self.depths: dict[int, int] = {}         # depth -> steps planned with it (a report's figure)
        self._step_index = 1                     # the step about to run, counted from 1
        self._num_calibration: dict[int, int] = {}   # batch-size class -> calibration steps planned
        self._plan: dict[str, int] = {}
        self._tracks: dict[str, AcceptanceEMA] = {}     # request id -> its acceptance estimate
        self._lock = threading.Lock()
        # best_depth's last answer and what it was judged on (``_judged``): a step with the same
        # acceptances and caps, under the same costs, has the same best depth (``_judge``)
        self._inputs_version = 0                 # bumped whenever an acceptance, the plan or the prior changes
                                                 # (in the table's key: its position profile and join rate)
        self._judged: tuple | None = None
        self._judged_depth: int | None = None
        self._same_step: tuple | None = None     # the requests and versions the last answer was given for
        self.set_cost_table(cost_table)

    # ---- from the planner (reporting thread) ---------------------------------------------
    def set_plan(self, num_drafts: dict[str, int], prior: float | None = None) -> None:
        """The planner's per-request counts (each request's cap here) and its cluster-wide
        acceptance, the start of a new request's estimate until this replica has its own."""
        self._plan = dict(num_drafts)
        if prior is not None:
            self.prior, self._prior_measured = prior, True
        self._inputs_version += 1

    def set_cost_table(self, table: StepCostTable | None) -> None:
        """Judge depths by ``table`` (every depth's timed cost at each batch size) instead of the
        fits of live steps; None: back to the fits. Neighbouring depths are then never explored
        for their cost; a step drafts at a depth the table does not judge best only to measure
        acceptance (``step_drafts``)."""
        self.cost_table = table
        self._judged = self._same_step = None
        # on a table a step at K=0 measures nothing more, so the replica's first trials must
        # move its estimate: a running mean beside the guessed prior (worth 2 trials) until
        # the EMA takes over. (The fits keep exploring neighbours and take the EMA alone; with
        # the faster start they lost at one request on the CPU's costs, 0.90x the best.)
        self.replica_acceptance.prior_trials = 2.0 if table is not None else float("inf")

    # ---- the engine's hooks (owner thread) ------------------------------------------------
    def observe_step(self, timing) -> None:
        """Feed the step-cost model with what the step ran and how long it took (None: the
        step ran nothing). With a cost table the fits are not fed (the table judges), only the
        table's record of live steps and the count of requests joining per token."""
        if timing is not None and timing.num_requests:
            self._batch = timing.num_requests
            if self.cost_table is not None:
                self.arrivals.observe(self._joined, timing.num_requests + self._accepted)
                self._joined = self._accepted = 0
                self.cost_table.observe(timing)
                if self._step_index % 16 == 0:       # judged again when it moved by 10% (a best_depth
                    rate = self.arrivals.per_token     # is ~40 us on a 2-core host, beside 0.5 ms steps)
                    if abs(rate - self._arrivals_per_token) > 0.1 * max(rate, self._arrivals_per_token):
                        self._arrivals_per_token = rate
                        self._inputs_version += 1
            else:
                self._last_fit = self.fit_for(timing.num_requests)
                self._last_fit.observe(timing)
        self._step_index += 1

    def draft_cost(self) -> float | None:
        """A draft level's cost in plain decode steps at the latest step's batch size, for the
        planner: the table's, or the latest fit's (None without one)."""
        if self.cost_table is not None:
            return self.cost_table.draft_cost(self._batch)
        return self.estimator.draft_cost()

    def forget_start_up(self) -> None:
        """Forget the live steps' costs (the fits, the table's drift; not the timed table) and
        every acceptance measured (back to the prior)."""
        if self.cost_table is not None:
            self.cost_table.forget_live()
        with self._lock:
            self._tracks.clear()
        self.replica_acceptance = AcceptanceEMA(self.prior, halflife_trials=64.0,
                                                prior_trials=self.replica_acceptance.prior_trials)
        self.positions = PositionAcceptance(len(self.positions.trials))
        self.arrivals = ArrivalRate()
        self._arrivals_per_token = 0.0
        self._joined = self._accepted = 0
        self._inputs_version += 1
        self.fits.clear()
        self._fit_by_size.clear()
        self._judged = self._same_step = None
        self._last_fit = None
        self._step_index = 1
        self._num_calibration.clear()
        self.depths.clear()

    def fit_for(self, num_requests: int) -> StepCostEstimator:
        """The step-cost fit of steps with about this many requests (``batch_class``)."""
        fit = self._fit_by_size.get(num_requests)
        if fit is None:
            c = batch_class(num_requests)
            fit = self.fits.get(c)
            if fit is None:
                fit = self.fits[c] = StepCostEstimator(pipelined_only=self.fit_pipelined_only)
            self._fit_by_size[num_requests] = fit
        return fit

    @property
    def estimator(self) -> StepCostEstimator:
        """The fit of the latest step's batch-size class (what the replica reports)."""
        return self._last_fit if self._last_fit is not None else self.fit_for(1)

    def observe_verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self._track(request_id).observe_step(num_drafts, num_accepted)
        self.replica_acceptance.observe_step(num_drafts, num_accepted)
        if self.cost_table is not None:      # what only the table's judgment reads (per request, per step)
            self._accepted += num_accepted
            self.positions.observe_step(num_drafts, num_accepted)
        self._inputs_version += 1

    def forget(self, request_id: str) -> None:
        """The request finished: drop its EMA."""
        with self._lock:
            self._tracks.pop(request_id, None)
        self._inputs_version += 1

    def explores(self, best: int) -> bool:
        """Whether this step takes a neighbouring depth instead of ``best``: every
        explore_interval-th step, or every idle_explore_interval-th while the best is 0 (and the
        ``explore_burst - 1`` steps after it)."""
        interval = self.explore_interval if best else self.idle_explore_interval
        return interval > 0 and self._step_index % interval < self.explore_burst

    def step_drafts(self, requests: list, uniform: bool) -> list[int]:
        if not requests or self.max_drafts == 0:
            return [0] * len(requests)
        top, plan = self.max_drafts, self._plan
        caps = [top] * len(requests)
        if plan:
            caps = [min(plan.get(r.request_id, top), top) for r in requests]
            top = sorted(caps)[len(caps) // 2] if uniform else max(caps)   # uniform: the planner's median
        if self.cost_table is not None:
            depth, exploring = self._table_depth(requests, caps, top, uniform)
        else:
            depth, exploring = self._fitted_depth(requests, caps, top, uniform)
        self.depths[depth] = self.depths.get(depth, 0) + 1
        if uniform:
            return [depth] * len(requests)
        if exploring:                  # a request the planner holds at 0 measures its acceptance too
            caps = [max(c, 1) for c in caps]
        return [min(depth, c) for c in caps]

    def _judge(self, judge, requests: list, caps: list[int], top: int, uniform: bool) -> int:
        """``best_depth`` by ``judge`` (a fit or the table), or its answer for the same inputs."""
        # what best_depth reads: the requests' acceptances and caps, and the costs. Keyed on the
        # acceptances, not the request ids: a request that replaces another at the replica's
        # value (every join while no step drafts) changes nothing (with the settled solves,
        # best_depth ran on 8% of the calls at 16 requests on a 2-core host, 17% before). The
        # table's judgment also reads the acceptance by position and join rate (_inputs_version).
        # First the same step again: the same requests, no acceptance, plan or prior changed since
        # (no ``observe_verified``, ``forget`` or ``set_plan``: every step while none drafts),
        # under the same costs: its answer without reading 16 acceptances (caps follow from the
        # plan and the requests).
        same = (self._inputs_version, judge, judge.version, judge.trusted_depth, uniform, top,
                tuple(map(_request_id, requests)))
        if same == self._same_step:
            return self._judged_depth
        alphas = [self._alpha(r) for r in requests]
        table = judge is self.cost_table
        key = (self._inputs_version if table else 0, judge, judge.version, judge.trusted_depth, uniform, top,
               tuple(caps), tuple(alphas))
        self._same_step = same
        if key != self._judged:
            # on the table, acceptance by position; the fits keep one for all (with the profile
            # they came to 0.935x the best at one request on the moderate costs, against 0.95x)
            profile = self.positions.relative() if table else None
            seconds = judge.seconds_at(len(requests), self._arrivals_per_token)
            depth = best_depth(alphas, caps, seconds, min(top, judge.trusted_depth), uniform, profile)
            self._judged, self._judged_depth = key, depth
        return self._judged_depth

    def _alpha(self, request) -> float:
        """The request's acceptance estimate (made on first use)."""
        return (self._tracks.get(request.request_id) or self._track(request.request_id)).value

    def _table_depth(self, requests: list, caps: list[int], top: int, uniform: bool) -> tuple[int, bool]:
        """(depth, exploring) by the timed table. Every depth's cost is known, so no step
        explores for cost; while the best depth is 0 a step drafts one only to measure
        acceptance (one, the cheapest: judged at acceptance 1 the probes went 4 deep, at 4.4x a
        plain step's cost), where acceptance 1 would make some depth pay (``_probe_depth``):

        - every step until the replica has measured ``min_prior_trials`` trials (the depth was
          judged on the guessed prior);
        - in a step of 1-3 requests, every ``probe_interval``-th step while one of them has
          fewer than ``min_request_trials`` trials of its own, judging those at acceptance 1
          (a request's start is the replica's value, and requests differ: in simulation at one
          request with acceptances 0.5, 0.9 and 0.7 by turns, the first one's 0.43 held every
          later one at K=0, 0.87-0.90x the best). Not in larger steps, where the replica's
          value is an average of many and a request's own is a small part of the step's
          choice: at 16 requests, such probes after each wave of new requests, with their
          head catch-up and the overlap they break, cost 3-12% where K=0 was best;
        - every ``idle_explore_interval``-th step, judging all at acceptance 1 (acceptance
          drifts with the workload)."""
        depth = self._judge(self.cost_table, requests, caps, top, uniform)
        if depth:
            return depth, False
        if not self._acceptance_known() or self.explores(0):
            probe = self._probe_depth(requests, caps, top, uniform, lambda r: True)
        elif self.probe_interval and self._step_index % self.probe_interval == 0:
            def unmeasured(r):
                track = self._tracks.get(r.request_id)
                return track is None or track.num_trials < self.min_request_trials
            probe = self._probe_depth(requests, caps, top, uniform, unmeasured) if len(requests) < 4 else 0
        else:
            probe = 0
        return (1, True) if probe else (0, False)

    def _probe_depth(self, requests: list, caps: list[int], top: int, uniform: bool, optimistic) -> int:
        """The table's best depth with the requests ``optimistic(request)`` says at acceptance 1
        (0 when none is)."""
        alphas = [1.0 if optimistic(r) else self._alpha(r) for r in requests]
        if all(a < 1.0 for a in alphas):
            return 0
        n = len(requests)
        return best_depth(alphas, caps, self.cost_table.seconds_at(n, self._arrivals_per_token),
                          min(top, self.cost_table.depth), uniform)

    def _fitted_depth(self, requests: list, caps: list[int], top: int, uniform: bool) -> tuple[int, bool]:
        """(depth, exploring) by the fits of live steps, calibrating and exploring neighbours
        so that they see more than one depth."""
        fit = self.fit_for(len(requests))
        # the own fit; before the class has one, the nearest class's, trusted only to say that no
        # depth pays (then calibrating would pay every request's head catch-up since it last
        # drafted, for a level the neighbour judged too dear). A fit is trusted one depth past
        # the deepest it has seen (it climbs a level at a time).
        judge = fit if fit.coefficients() is not None else self._nearest_fit(len(requests))
        depth = None
        if judge is not None:
            depth = self._judge(judge, requests, caps, top, uniform)
            if judge is not fit and depth > 0:
                depth = None
            elif judge is fit and depth == 0 and not self._acceptance_known():
                depth = None         # "no depth pays" judged on the prior alone: measure it first
        if depth is None:                                # calibration: 0, 1, 0, 1, ...
            c = batch_class(len(requests))
            depth = self._num_calibration.get(c, 0) // self.calibration_burst % 2
            self._num_calibration[c] = self._num_calibration.get(c, 0) + 1
            return depth, False
        if self.explores(depth):
            return self._neighbour(depth), True
        return depth, False

    def _acceptance_known(self) -> bool:
        """Whether the acceptance the depths are judged on was measured (the replica's own
        ``min_prior_trials`` trials, or the planner's cluster-wide value) rather than the
        guessed prior: judged on the guess, a replica where drafting pays only moderately
        found "no depth pays", stopped drafting and so never measured it (a closed-loop
        simulation at one request with the H200's bundled step costs sat at K=0, 0.93x the
        best fixed K)."""
        return self._prior_measured or self.replica_acceptance.num_trials >= self.min_prior_trials

    def _nearest_fit(self, num_requests: int) -> StepCostEstimator | None:
        """The fitted estimator of the batch-size class nearest this one (the larger on a tie:
        its drafts are the dearer), or None."""
        c = batch_class(num_requests)
        fitted = [(abs(k - c), -k, f) for k, f in self.fits.items() if k != c and f.coefficients() is not None]
        return min(fitted, key=lambda t: t[:2])[2] if fitted else None

    def _neighbour(self, depth: int) -> int:
        """An exploring step's depth: one below and one above by turns, within 0..max_drafts."""
        if depth == 0:
            return 1
        if depth == self.max_drafts:
            return depth - 1
        return depth + 1 if (self._step_index // self.explore_interval) % 2 else depth - 1

    def _track(self, request_id: str) -> AcceptanceEMA:
        """The request's acceptance estimate, made on first use: from the replica's measured
        acceptance, or the planner's prior until there is one."""
        track = self._tracks.get(request_id)
        if track is None:
            measured = self.replica_acceptance.num_trials >= self.min_prior_trials
            start = self.replica_acceptance.value if measured else self.prior
            with self._lock:
                track = self._tracks[request_id] = AcceptanceEMA(start)
            if self.cost_table is not None:
                self._joined += 1                 # a request new to the decoding batch
        return track

    def acceptance(self) -> dict[str, tuple[float, int]]:
        """{request id: (EMA of prefix acceptance, trials seen)} for the report to the planner."""
        with self._lock:
            return {rid: (t.value, t.num_trials) for rid, t in self._tracks.items()}
