"""Where an engine step's time goes: milliseconds per step of each engine phase.

    mtpserve bench --phases on|sync [--device cuda] [--draft-tokens 0,2] [--concurrency 1,16] ...
    mtpserve serve --stall-phases on      (each stall in a replica's status says its step's phases)

``PhaseTimers`` wraps the phase methods of one ``Engine`` (instance attributes only: the class
and every other engine are untouched, and the wrapped methods behave as before) and adds up, per
step, the wall time spent in each. Steps that feed prompt tokens ("prefill", what TTFT waits
for), the step right after each of them that feeds none ("after_prefill": where an overlapped
engine restarts its pipeline, and an MTP engine's head catches up on the new prompts) and the
other decode-only steps ("decode") are summed apart. A phase's time includes the phases it calls:

    step
    ├── schedule
    ├── propose ── head replay (captured, chained on the device) | head eager,
    │              head catch-up (a new prompt's rows: head fill replay | head eager)
    ├── verify ─── main replay (captured) | main eager
    ├── processed (penalties, min_tokens and grammar masks on the logits), accept_step
    ├── score_prompts, update_from_output ── commit_step (the state bank's commit and replay)
    ├── keep_hidden, cache_prefixes, logprobs, outputs.process
    ├── launch (overlapped decoding: a step, or the continuation of the one in flight, queued
    │   and committed) ── verify | main replay, processed, commit_step, keep_hidden
    ├── land (the step in flight: its tokens read, appended, events) ── cache_prefixes,
    │   outputs.process
    └── observe_step (the draft policy)

"other" is the step's time outside every outermost phase (the step's own glue). On CUDA the
engine's launches are asynchronous: without synchronisation a phase is charged for the launches
it makes and for the waits it meets (the first read of a result, usually accept_step's); with
``sync`` the device is synchronised after every outermost phase, so each owns its GPU work (and
the step gets slower by the lost overlap).
"""

from __future__ import annotations

import functools
import time

import numpy as np

from mtpserve.engine import engine as engine_module

# (the owner's path from the engine, its method, the phase's name); a missing owner is skipped
PHASES = (
    ("scheduler", "schedule", "schedule"),
    ("proposer", "propose", "propose"),
    ("proposer.graphs", "draft", "head replay"),
    ("proposer", "_catch_up_long", "head catch-up"),
    ("proposer.graphs", "fill", "head fill replay"),
    ("runner", "run_head", "head eager"),
    ("", "_launch", "launch"),
    ("", "_land", "land"),
    ("", "_verify", "verify"),
    ("graphs", "run", "main replay"),
    ("runner", "run_main", "main eager"),
    ("", "_processed", "processed"),
    ("", "_score_prompts", "score_prompts"),
    ("scheduler", "update_from_output", "update_from_output"),
    ("state_bank", "commit_step", "commit_step"),
    ("proposer", "keep_step", "keep_hidden"),        # keep_hidden calls it too
    ("scheduler", "cache_prefixes", "cache_prefixes"),
    ("", "_logprobs", "logprobs"),
    ("outputs", "process", "outputs.process"),
    ("draft_policy", "observe_step", "observe_step"),
)
ACCEPT = "accept_step"          # a module function of mtpserve.engine.engine, not a method


class PhaseTimers:
    """Per-step phase times of one engine; ``reset`` before a load, ``summary`` after it."""

    _current: PhaseTimers | None = None        # the timers of the step under way (accept_step's)

    def __init__(self, engine, sync: bool = False, keep_steps: bool = True):
        """``keep_steps``: every step's phases in ``steps`` (a benchmark's load); else only the
        last step's, in ``last`` (a server's: its memory stays flat)."""
        self.engine = engine
        self.sync = sync and engine.xp is not np          # nothing to wait for on the CPU
        self.keep_steps = keep_steps
        self.last: dict[str, float] = {}                  # the last counted step's phases (seconds)
        self._depth = 0
        self._step: dict[str, float] = {}
        self._outer = 0.0                       # this step's time inside outermost phases
        self.reset()
        self._install()

    def reset(self) -> None:
        self.steps: dict[str, list[dict[str, float]]] = {"prefill": [], "after_prefill": [], "decode": []}
        self._prefill_before = False            # the last counted step fed prompt tokens

    def _install(self) -> None:
        e = self.engine
        for path, method, name in PHASES:
            owner = e
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part, None)
            if owner is not None and hasattr(owner, method):
                setattr(owner, method, self._timed(getattr(owner, method), name))
        step = e.step

        @functools.wraps(step)
        def timed_step(*args, **kwargs):
            PhaseTimers._current, self._step, self._outer = self, {}, 0.0
            started = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                total = time.perf_counter() - started
                PhaseTimers._current = None
                last = e.last_step
                if last is not None:            # a step that scheduled nothing is not counted
                    self._step["step"] = total
                    self._step["other"] = total - self._outer
                    self.last = self._step
                    if self.keep_steps:
                        kind = "prefill" if last.has_prefill else "after_prefill" if self._prefill_before else "decode"
                        self.steps[kind].append(self._step)
                    self._prefill_before = last.has_prefill
        e.step = timed_step
        _install_accept_step()
        self._accept = self._timed(_ACCEPT_STEP, ACCEPT)   # what the module's accept_step runs in our steps

    def _timed(self, fn, name: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._depth += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync and self._depth == 1:
                    self.engine.xp.cuda.Device().synchronize()
                seconds = time.perf_counter() - started
                self._depth -= 1
                self._step[name] = self._step.get(name, 0.0) + seconds
                if self._depth == 0:
                    self._outer += seconds
        return timed

    def summary(self) -> dict:
        """{"prefill"|"after_prefill"|"decode": {"steps", "ms_per_step", "phases_ms_per_step":
        {phase: ms}}}, the phases largest first; kinds without steps left out."""
        out = {}
        for kind, steps in self.steps.items():
            if not steps:
                continue
            names = {n for s in steps for n in s} - {"step"}
            phases = {n: 1e3 * sum(s.get(n, 0.0) for s in steps) / len(steps) for n in names}
            out[kind] = {"steps": len(steps), "ms_per_step": 1e3 * sum(s["step"] for s in steps) / len(steps),
                         "phases_ms_per_step": {n: round(v, 4) for n, v in
                                                sorted(phases.items(), key=lambda kv: -kv[1])}}
        return out


_ACCEPT_STEP = engine_module.accept_step        # the engine's own, before any wrapping


def _install_accept_step() -> None:
    """Route the engine module's accept_step through the timers of the step under way (once)."""
    if engine_module.accept_step is not _ACCEPT_STEP:
        return

    @functools.wraps(_ACCEPT_STEP)
    def timed(*args, **kwargs):
        timers = PhaseTimers._current
        return _ACCEPT_STEP(*args, **kwargs) if timers is None else timers._accept(*args, **kwargs)
    engine_module.accept_step = timed
