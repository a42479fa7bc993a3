"""What a step costs, measured on the replica: the draft policy's cost models.

``StepCostEstimator`` fits live decode steps (a least-squares line in the main rows, the head's
forwards and its catch-up rows), one fit per batch-size class (``batch_class``);
``StepCostTable`` holds every batch size's and depth's step time, timed at start-up
(``--draft-calibration on``, ``engine/draft_calibration.py``). Both answer ``seconds_at(n)``:
the predicted seconds of a step of n requests at each depth, what ``draft_policy.best_depth``
judges by. No GPU in here: the engine hands each step's ``StepTiming``.
"""

from __future__ import annotations

import math

import numpy as np


def batch_class(num_requests: int) -> int:
    """Steps of 1, 2-3, 4-7, 8-15, ... requests: each class has a step-cost fit of its own. One
    fit for every batch size extrapolated from where most steps were: after a while at one
    request (a + b and b + c fixed, b alone not), the first steps at 16 were predicted cheap to
    draft deep: on a 2-core CPU, run after C=1, auto came to 0.92x K=0 (0.83x the best fixed K)
    at C=16 (``bench --rounds 3``)."""
    return max(1, int(num_requests)).bit_length()


def linear_seconds(coefficients):
    """``seconds(depth, main_rows, head_rows, tokens)`` of the linear model (a, b, c, h)."""
    a, b, c, h = coefficients
    return lambda depth, rows, head_rows, tokens: a + b * rows + c * depth + h * head_rows


class StepCostEstimator:
    """The replica's measured step time,
    ``seconds ~ a + b * main_rows + c * head_forwards + h * head_rows``.

    Fitted by exponentially weighted least squares (a small ridge keeps it solvable) over decode
    steps (steps with a prompt chunk cost differently and are skipped). ``head_rows`` are the
    rows the head catches up on before drafting (every position since the request last drafted):
    about one per token kept while a request drafts every step, its whole history when it drafts
    again after a pause. Without that term a pause's catch-up read as the cost of a draft level,
    and a replica that once stopped drafting judged drafting too dear to start again (the tests'
    closed-loop simulation at C=1 with CPU costs stayed at K=0, 0.86x the best fixed K).

    With B requests decoding, K drafts each add B main-model rows and K head forwards, so the
    marginal cost of one draft level relative to a plain decode step is ``(b*B + c) / (a + b*B)``:
    what ``draft_cost()`` returns (the catch-up left out), or None until enough steps with
    different draft counts were seen.

    The coefficients are not clipped: at a steady batch every step's rows are B * (1 + K), so
    they are fixed only up to directions along which every predicted step time, and the draft
    cost, stay the same; clipping one of them to zero moved the predictions (in the simulation, a
    draft level at 0.48 of a step was read as 0.73).

    One-off stalls are left out of the fit (a garbage collection, a first call of some kernel,
    the host descheduled). The first ``min_steps`` steps are held until they are enough for a
    fit; then those over ``outlier_factor`` times the median of the steps with their number of
    head forwards are dropped, and the rest fitted (in the simulation, one stall among them had
    made the first draft level look 13 times its cost, and a policy held at no drafts hardly ever sees enough
    steps with drafts to correct it). After that, a step over ``outlier_factor`` times its
    prediction is counted in ``num_outliers`` and skipped, unless it is the
    ``max_outliers_in_a_row``-th such step in a row: then the costs really changed, and it and
    the ones after it are fitted until a step is within the bound again. (Start-up steps that
    paid one-time costs had put a = 0.33 s into the fit on the H200, against ~1.5 ms steps, for
    hundreds of steps: every draft looked as dear as a whole step.)
    """

    def __init__(self, halflife_steps: float = 200.0, min_steps: int = 12,
                 outlier_factor: float = 4.0, max_outliers_in_a_row: int = 8, solve_every: int = 8,
                 pipelined_only: bool = False, settled_solve_every: int = 32, settling_steps: int = 256):
        """solve_every: the fit is solved again after this many fitted steps (a solve is ~60 us
        on a 2-core host; the fit's half-life is ``halflife_steps``) while it settles: its first
        ``settling_steps`` fitted steps, and as many after the costs changed (a run of
        ``max_outliers_in_a_row`` outliers); then every ``settled_solve_every``. (With this and
        ``_judge`` keyed on acceptances, the policy's host time at 16 requests on a 2-core host
        went 57-63 -> 37-40 us a step: ``results/policy-host-cost/policy_host_cost.py``.) pipelined_only: leave out
        the steps an overlapping engine ran alone (``StepTiming.pipelined`` False: a step that
        changed kind, drafting or not, paid its launch and GPU time in full, which steps of a
        steady depth do not), counting them in ``num_alone``."""
        self.solve_every = solve_every
        self.settled_solve_every = max(solve_every, settled_solve_every)
        self.settling_steps = settling_steps
        self._settled_after = settling_steps       # fitted steps after which it solves less often
        self.pipelined_only = pipelined_only
        self.num_alone = 0
        self._decay = 0.5 ** (1.0 / halflife_steps)
        self.min_steps = min_steps
        self.outlier_factor = outlier_factor
        self.max_outliers_in_a_row = max_outliers_in_a_row
        self.num_steps = 0
        self.num_outliers = 0
        self.num_solves = 0                # times the fit was solved (its coefficients' version)
        self._outliers_in_a_row = 0
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self._unfolded: list[tuple[float, float, float, float, float]] = []  # fitted steps not yet in _xx, _xy
        self._batch = 0.0
        self._head_levels: set[int] = set()
        self._deepest = 0                  # max(_head_levels)
        self._held: list[tuple[tuple, float, int]] = []    # the latest steps, until a fit
        self._coefficients: tuple[float, float, float, float] | None = None
        self._solved = False               # False: solve again at the next coefficients()

    def observe(self, timing) -> None:
        """One engine step (an ``engine.StepTiming``)."""
        if timing is None or timing.has_prefill or timing.num_requests == 0:
            return
        if self.pipelined_only and timing.pipelined is False:
            self.num_alone += 1
            return
        x = (1.0, float(timing.num_main_tokens), float(timing.num_head_forwards), float(timing.num_head_rows))
        if self.num_steps < self.min_steps or len(self._head_levels) < 2:
            self._hold(x, timing.seconds, timing.num_requests)
            return
        a, b, c, h = self.coefficients()
        if timing.seconds > self.outlier_factor * (a + b * x[1] + c * x[2] + h * x[3]):
            self._outliers_in_a_row += 1
            if self._outliers_in_a_row < self.max_outliers_in_a_row:
                self.num_outliers += 1
                return
            self._settled_after = self.num_steps + self.settling_steps     # the costs changed: settle again
        else:
            self._outliers_in_a_row = 0
        self._add(x, timing.seconds, timing.num_requests)

    def _hold(self, x: tuple, seconds: float, num_requests: int) -> None:
        """Before the first fit: keep the step; once they are enough, fit those within
        ``outlier_factor`` of their head level's median."""
        self._held.append((x, seconds, num_requests))
        if len(self._held) > 4 * self.min_steps:      # one head level only (no drafts at all): bounded
            del self._held[0]
        levels = {int(x[2]) for x, _, _ in self._held}
        if len(self._held) < self.min_steps or len(levels) < 2:
            return
        median = {k: float(np.median([s for x, s, _ in self._held if int(x[2]) == k])) for k in levels}
        kept = [(x, s, n) for x, s, n in self._held if s <= self.outlier_factor * median[int(x[2])]]
        if len(kept) < self.min_steps or len({int(x[2]) for x, _, _ in kept}) < 2:
            return                                    # too many stalls among them: hold on
        self.num_outliers += len(self._held) - len(kept)
        self._held = []
        for x, s, n in kept:
            self._add(x, s, n)

    def _add(self, x: tuple, seconds: float, num_requests: int) -> None:
        """Fit one step. Its row waits in ``_unfolded`` until the next solve folds it in (on the
        owner thread, every step: with a numpy update per step, ``observe_step`` took 13.4 us at
        16 requests on a 2-core host, 6.0 us folded, beside ~0.5 ms GPU steps)."""
        self._unfolded.append((*x, seconds))
        every = self.solve_every if self.num_steps < self._settled_after else self.settled_solve_every
        if len(self._unfolded) >= every or self._coefficients is None:
            self._solved = False
        w = 0.0 if self.num_steps else 1.0
        w = max(w, 1.0 - self._decay)
        self._batch += w * (num_requests - self._batch)
        level = int(x[2])
        if level not in self._head_levels:
            self._head_levels.add(level)
            self._deepest = max(self._head_levels)
        self.num_steps += 1

    @property
    def deepest(self) -> int:
        """The most head forwards of a step fitted so far."""
        return self._deepest

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, h) in seconds, or None while the steps seen cannot separate them."""
        if self.num_steps < self.min_steps or len(self._head_levels) < 2:
            return None
        if not self._solved:
            self._fold()
            ridge = 1e-6 * max(self._xx[0, 0], 1.0) * np.eye(4)
            a, b, c, h = np.linalg.solve(self._xx + ridge, self._xy)
            self._coefficients, self._solved = (float(a), float(b), float(c), float(h)), True
            self.num_solves += 1
        return self._coefficients

    def _fold(self) -> None:
        """The unfolded steps into the weighted sums, as if each had been added in turn:
        ``xx = decay^k xx + sum_i decay^(k-1-i) x_i x_i^T`` (and ``xy`` alike) for steps i < k."""
        if not self._unfolded:
            return
        rows = np.asarray(self._unfolded)
        self._unfolded = []
        k = len(rows)
        x, y = rows[:, :4], rows[:, 4]
        w = self._decay ** np.arange(k - 1, -1, -1, dtype=np.float64)
        xw = x * w[:, None]
        self._xx = self._decay ** k * self._xx + xw.T @ x
        self._xy = self._decay ** k * self._xy + xw.T @ y

    @property
    def version(self) -> int:
        """Changes whenever the predicted step times do (a new solve)."""
        return self.num_solves

    @property
    def trusted_depth(self) -> int:
        """The deepest step the fit's prediction is taken for: one past the deepest it saw (a
        policy on a fit climbs a level at a time)."""
        return self.deepest + 1

    def seconds_at(self, num_requests: int, arrivals_per_token: float = 0.0):
        """``seconds(depth, main_rows, head_rows, tokens)`` of a decode step by the fit (None
        without one): what ``best_depth`` judges a step of ``num_requests`` by (the fit has no
        join term: ``arrivals_per_token`` is not used)."""
        coef = self.coefficients()
        return None if coef is None else linear_seconds(coef)

    def draft_cost(self) -> float | None:
        """A draft level's cost in plain decode steps at the recent batch size (the planner's
        input; the head's catch-up left out), at least 0; None without a fit."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c, _ = coef
        plain = a + b * self._batch
        return max(0.0, (b * self._batch + c) / plain) if plain > 0.0 else None


class StepCostTable:
    """A decode step's seconds by batch size and draft depth, timed on the replica's own device
    at start-up (``engine/draft_calibration.py``): what ``--draft-tokens auto`` judges depths by
    where one was timed (CUDA, by default).

    Why a table and not the fit: on the H200 a step's cost is not a line in its draft levels. A
    drafting step pays ~0.37 ms before its first level (the bundled model at 16 requests: K=0
    0.49 ms, K=2 1.35, K=3 1.60), and with overlapped decoding a step that changes kind runs
    alone while steps of one kind hide part of their cost behind each other. A fit that sees one
    or two depths at a time extrapolates the others from them, and it had two stable states
    there: held at K=0, or held at K=4 at 0.55-0.80x K=0 (results/h200, sessions ax, ay). Here
    every depth's cost is measured at every timed batch size, each as a steady run of that depth.

    Between timed batch sizes the seconds are interpolated linearly, past the largest
    extrapolated along its last segment (never below it); at each size a deeper step never costs
    less than a shallower one (timing noise cannot make a deeper step look free)::

        seconds
          |            d=2 ___----o
          |        o---
          |      /      d=0 ___---o
          |    o----o---
          +----1----2----4--------8----> batch size (timed sizes: o; between them, lines)

    ``joins`` (optional): per (size, depth >= 1), what a request that joins the decoding batch
    costs beyond steady steps, more than it costs at depth 0 (its prompt's step breaks the
    overlap, and its first drafting step makes the head catch up on the whole prompt). On the
    H200 at 16 requests, drafting steps averaged 1.52 ms against ~1.25 steady, ~1.4 ms more per
    joining request (results/h200 session z); with 128-token outputs a request joins every
    2.5 steps at K=3, which made K=3 lose to K=0 where its steady steps won by 17%. A step's
    price at depth d is then ``seconds[d] + arrivals_per_token * tokens(d) * joins[d]``, with
    the replica's measured rate of joining requests per emitted token (``ArrivalRate``).

    The table is not refitted as the replica runs (a multiplicative drift of the host's speed
    leaves the best depth unchanged); ``observe`` keeps, per depth, the running ratio of the
    live decode steps' seconds to the table's (``drift`` for pipelined steps, ``alone`` for the
    others) and their total, for reports: what a measurement on the device needs to say whether
    live steps cost what the table says.
    """

    def __init__(self, seconds: dict[tuple[int, int], float], joins: dict[tuple[int, int], float] | None = None,
                 max_rows: int | None = None):
        """seconds: {(batch size, depth): a steady step's seconds}, every depth 0..D at every
        size (infinite: a step no budget lets run); joins: {(batch size, depth): a joining request's extra seconds at that depth over
        depth 0} (missing ones, and depth 0, are 0; negative ones are taken as 0); max_rows: the
        step's token budget: a step of n requests at depth d needs n * (1 + d) rows, and one
        that does not fit is priced infinite at any size (the scheduler would cut its drafts)."""
        sizes = sorted({n for n, _ in seconds})
        depth = max((d for _, d in seconds), default=-1)
        if not sizes or sizes[0] < 1:
            raise ValueError(f"a step-cost table needs batch sizes >= 1, got {sizes}")
        missing = [(n, d) for n in sizes for d in range(depth + 1) if (n, d) not in seconds]
        if missing or any(not v > 0 for v in seconds.values()):
            raise ValueError(f"a step-cost table needs a positive time for every (size, depth): missing {missing}")
        grid = np.array([[seconds[n, d] for d in range(depth + 1)] for n in sizes], dtype=np.float64)
        self.sizes = tuple(sizes)
        self.depth = depth
        self.grid = np.maximum.accumulate(grid, axis=1)         # [size, depth]: never cheaper deeper
        joins = joins or {}
        self.join_grid = np.array([[max(0.0, joins.get((n, d), 0.0)) if d else 0.0 for d in range(depth + 1)]
                                   for n in sizes], dtype=np.float64)
        self.measured = dict(seconds)
        self.max_rows = max_rows
        self.drift: dict[int, float] = {}                        # depth -> live / table, running (pipelined)
        self.alone: dict[int, float] = {}                        # ... of decode steps that ran alone
        self.seconds_by_depth: dict[int, tuple[int, float]] = {}  # depth -> (live decode steps, seconds)
        self._by_size: dict[int, tuple[list[float], list[float]]] = {}   # size -> (step, join seconds by depth)

    @classmethod
    def from_samples(cls, samples: dict[tuple[int, int], list[float]],
                     joins: dict[tuple[int, int], list[float]] | None = None,
                     max_rows: int | None = None) -> StepCostTable:
        """The table of each (size, depth)'s median of timed steps (and of timed joins)."""
        return cls({key: float(np.median(times)) for key, times in samples.items() if times},
                   {key: float(np.median(v)) for key, v in (joins or {}).items() if v}, max_rows)

    version = 0                 # its predictions never change (StepCostEstimator's change with each solve)

    @property
    def trusted_depth(self) -> int:
        return self.depth

    def _at(self, grid: np.ndarray, n: int) -> np.ndarray:
        """``grid``'s row at batch size ``n``: interpolated, extrapolated past the largest size
        along its last segment, never below the largest size's row."""
        sizes = self.sizes
        if len(sizes) == 1:
            return grid[0]
        i = min(max(int(np.searchsorted(sizes, n)) - 1, 0), len(sizes) - 2)
        lo, hi = sizes[i], sizes[i + 1]
        t = (n - lo) / (hi - lo)
        if t == 0.0:
            return grid[i]
        with np.errstate(invalid="ignore"):        # inf - inf: a depth no step of either size can run
            row = grid[i] + t * (grid[i + 1] - grid[i])
        # a depth one of the sizes cannot run (infinite) is priced infinite between them
        row = np.where(np.isinf(grid[i]) | np.isinf(grid[i + 1]), np.inf, row)
        return np.maximum(row, grid[-1]) if n > sizes[-1] else row

    def step_seconds(self, num_requests: int) -> list[float]:
        """Seconds of a steady step of ``num_requests`` at each depth 0..D."""
        out = self._by_size.get(num_requests)
        if out is None:
            n = max(1, num_requests)
            steps = [float(x) for x in np.maximum.accumulate(self._at(self.grid, n))]
            if self.max_rows is not None:
                steps = [x if d == 0 or n * (1 + d) <= self.max_rows else math.inf for d, x in enumerate(steps)]
            out = self._by_size[num_requests] = (steps, [max(0.0, float(x)) for x in self._at(self.join_grid, n)])
        return out[0]

    def join_seconds(self, num_requests: int) -> list[float]:
        """A joining request's extra seconds at each depth 0..D over depth 0, at this size."""
        self.step_seconds(num_requests)
        return self._by_size[num_requests][1]

    def seconds_at(self, num_requests: int, arrivals_per_token: float = 0.0):
        """``seconds(depth, main_rows, head_rows, tokens)`` for ``best_depth``: the table's
        time of the depth at this batch size, and its joins' share (``arrivals_per_token *
        tokens`` requests join per step; see the class docstring). Rows are the uniform step's:
        a step whose requests the planner caps below the depth is priced as if each carried
        it, slightly dear."""
        row, joins = self.step_seconds(num_requests), self.join_seconds(num_requests)
        if not arrivals_per_token:
            return lambda depth, rows, head_rows, tokens: row[depth]
        return lambda depth, rows, head_rows, tokens: row[depth] + arrivals_per_token * tokens * joins[depth]

    def draft_cost(self, num_requests: int) -> float | None:
        """A draft level's mean cost in plain decode steps at this batch size, from K=0 to the
        deepest depth a step of this size can run (the planner's linear cost model); None
        where none can."""
        row = self.step_seconds(num_requests)
        deepest = max((d for d in range(1, self.depth + 1) if math.isfinite(row[d])), default=0)
        return (row[deepest] - row[0]) / (deepest * row[0]) if deepest else None

    def observe(self, timing) -> None:
        """A live decode step: a pipelined (or not overlapped) one updates its depth's
        ``drift``, one that ran alone its depth's ``alone`` (live / table, running), and either
        adds its seconds to ``seconds_by_depth`` (how the live time of each depth splits)."""
        if timing is None or timing.has_prefill or not timing.num_requests:
            return
        d = timing.num_head_forwards
        table = self.step_seconds(timing.num_requests)[d] if d <= self.depth else math.inf
        if not math.isfinite(table):
            return
        ratio = timing.seconds / table
        ratios = self.alone if timing.pipelined is False else self.drift
        old = ratios.get(d)
        ratios[d] = ratio if old is None else old + 0.02 * (ratio - old)
        steps, seconds = self.seconds_by_depth.get(d, (0, 0.0))
        self.seconds_by_depth[d] = (steps + 1, seconds + timing.seconds)

    def forget_live(self) -> None:
        """Forget what live steps said (start-up's steps)."""
        self.drift.clear()
        self.alone.clear()
        self.seconds_by_depth.clear()

    def report(self) -> dict:
        """The timed steps in ms by size and depth, and what live decode steps said of them, for
        logs and JSON: by depth, the running live / table ratio of pipelined steps (drift) and
        of steps run alone (alone), and the steps seen and their ms in all (live)."""
        return {"sizes": list(self.sizes),
                "ms": [[round(float(x) * 1e3, 4) for x in row] for row in self.grid],
                "join_ms": [[round(float(x) * 1e3, 4) for x in row] for row in self.join_grid],
                "drift": {d: round(r, 3) for d, r in sorted(self.drift.items())},
                "alone": {d: round(r, 3) for d, r in sorted(self.alone.items())},
                "live": {d: [n, round(t * 1e3, 2)] for d, (n, t) in sorted(self.seconds_by_depth.items())}}
