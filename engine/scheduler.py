"""The scheduler: owns the queues, each request's status and the pools; plans steps and commits them.

Nothing else reserves, commits, trims or releases pool space (main KV, the MTP head's KV, the
fixed-state bank). A step is

    schedule()                 -> StepPlan: which requests run, their tokens and drafts, their
                                  packed rows (StepLayout); pool space reserved for all of it
    (the engine runs drafts and the verify forward, and accepts)
    update_from_output(plan, StepOutput) -> one RequestUpdate per scheduled request: pools
                                  committed, accepted tokens appended up to a stop id or a limit
                                  (= commit_rows + append_tokens, which overlapped decoding
                                  calls apart: at a step's launch and when it lands)
    finish(request, reason)    releases everything a finished request held (or, under a step
                                  still in flight, holds it in ``releasing`` until
                                  ``release_finished``)

Planning rules. One token budget and one batch limit are shared by prefill chunks, decodes and
drafts:

1. Running requests first, oldest first (decode-first): a decoding request feeds its newest
   token plus K drafts (K from the draft policy, capped by min(7, capture capacity, the step's
   budget left, its output budget left, the context left); under ``uniform_drafts`` not by its
   output budget: drafts past max_tokens are verified and dropped, as after a stop id, rather
   than cut, which would make the whole step eager); a running request still in its prompt
   feeds the next chunk of it.
2. Then waiting requests, oldest first, are admitted while a state row, KV blocks, budget and
   batch slots remain; each feeds the first chunk of its prompt (chunked prefill). While every
   running request decodes, new requests may be held (``admission_due``): they are admitted
   together once ``admission_group`` per decoding request wait, or when the oldest has waited
   ``admission_hold_steps`` landed steps (MTP engines only). On CUDA a prompt step costs about
   as much for one prompt as for several, and in an MTP engine it also breaks the pipeline of
   draft steps (the next one is launched alone); requests end on steps their acceptance sets,
   so without the hold each arrival paid both of its own. Measured on the H100 (bundled model,
   C=16, lengths 64-192, session 27): K=2 1.10x -> 1.31x K=0, time to first token p50 4.8 ->
   8.0 ms, p99 +8-12 ms; K=0 gains nothing from a hold (1.00x; at C=8 it lost 5%), so an engine
   without MTP does not hold. With ``admission_lookahead``, a gathered group still waits
   (within the hold) while a running request is expected to reach its max_tokens within that
   many steps: when requests of one length run together (waves), their ends come a few steps
   apart and each end brings an arrival (a closed loop) or frees a slot, so the whole wave's
   arrivals share one prompt step rather than a group's worth each.
3. Drafts are deferred (K = 0) in a step that carries any prefill chunk: such a step's state
   captures do not cover every fed token, so a partial keep could not be rolled back. (The
   CPU path's converted graph captures every token, so breaking this rule changes no CPU
   output; ORT's CUDA kernels do not.) A waiting request that a preemption in a drafting step
   made room for waits for a step without drafts.
4. The draft policy plans the step's drafts at once (``DraftPolicy.step_drafts``), before the
   caps, for every decoding request (a seeded sampled one's tokens do not depend on its K).
   With ``uniform_drafts`` (CUDA graphs: a captured verify step has one shape, 1 + K rows for
   every request) the plan is one K for the step, and a decoding request whose 1 + K rows no
   longer fit the step's budget waits for the next step instead of carrying fewer drafts.

Reservations are all-or-nothing per request: main KV for everything the step feeds, the MTP
head's KV for its catch-up and chained rows. When the pools run out the scheduler first trims
the unscheduled requests' spare lookahead, then preempts the newest running request (frees
everything, requeues it for recompute) instead of failing anyone. Admissions never preempt.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mtpserve.engine.config import MAX_DRAFT_TOKENS, SchedulerConfig
from mtpserve.engine.draft_policy import DraftPolicy
from mtpserve.engine.kv_pool import KVPool
from mtpserve.engine.prefix_cache import PrefixCache, PrefixHit
from mtpserve.engine.request import FinishReason, Request, RequestStatus
from mtpserve.engine.speculative import SpecDecodeStats
from mtpserve.engine.state_bank import StateBank, StepCaptures, StepStates


@dataclass
class ScheduledRequest:
    """One request's part of a step."""
    request: Request
    num_tokens: int          # tokens fed from request.token_ids[num_computed:]
    num_drafts: int = 0      # draft rows appended after them (verified this step)
    samples: bool = field(init=False)   # the step reaches the end of the tokens: new tokens come out

    def __post_init__(self) -> None:
        self.samples = self.num_tokens == self.request.num_to_feed


@dataclass(frozen=True)
class StepLayout:
    """Where each scheduled request's rows sit in the step's packed forward, computed once.

        request      r0: 3 tokens + 2 drafts | r1: 1 + 0 | r2: 1 + 1
        packed row   0  1  2  3  4           | 5         | 6  7
        row_start    0                       | 5         | 6
        num_rows     5                       | 1         | 2
        target_row   2 (its newest token)    | 5         | 6

    Request i's target rows are target_row[i] .. target_row[i] + num_drafts[i]: they check its
    drafts d0.. in turn, and the last gives the bonus token.
    """
    row_start: list[int]
    num_rows: list[int]       # num_tokens + num_drafts
    target_row: list[int]     # row_start + num_tokens - 1

    @staticmethod
    def of(scheduled: list[ScheduledRequest]) -> StepLayout:
        num_rows = [s.num_tokens + s.num_drafts for s in scheduled]
        row_start = [0, *itertools.accumulate(num_rows)][:-1]
        return StepLayout(row_start, num_rows, [r + s.num_tokens - 1 for r, s in zip(row_start, scheduled)])


@dataclass
class StepPlan:
    """What one step runs: scheduled requests in state-row order, and the queue moves made."""
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    layout: StepLayout | None = None
    request_ids: list[str] = field(default_factory=list)    # of `scheduled`, in order; set once by schedule()
    prefix_hits: dict[str, PrefixHit] = field(default_factory=dict)   # admitted requests that start from the cache

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens + s.num_drafts for s in self.scheduled)


@dataclass
class StepOutput:
    """What the forward and the acceptance produced, handed to ``update_from_output``.

    sampled: {request id: (emitted tokens, drafts accepted)} of the requests that sampled;
    present / captures: the main model's fixed-state outputs (opaque arrays for the state bank).
    """
    sampled: dict[str, tuple[list[int], int]]
    present: StepStates
    captures: StepCaptures | None = None


@dataclass
class RequestUpdate:
    """One scheduled request after its step: tokens appended, rows kept, and why it ended."""
    request: Request
    new_token_ids: list[int]
    num_kept: int                       # fed rows folded into KV and state (drafts accepted + 1, or the chunk)
    finish_reason: FinishReason | None = None


class Scheduler:
    """Owns waiting / running requests and every pool; see the module docstring."""

    def __init__(self, config: SchedulerConfig, kv_pool: KVPool, head_pool: KVPool | None,
                 state_bank: StateBank, draft_policy: DraftPolicy, capture_capacity: int,
                 context_length: int, prefix_cache: PrefixCache | None = None):
        if config.max_tokens_per_step is None:
            raise AssertionError("a scheduler needs a token budget: SchedulerConfig.for_device fills the default")
        self.config = config
        self.kv_pool = kv_pool
        self.head_pool = head_pool
        self.state_bank = state_bank
        self.draft_policy = draft_policy
        self.max_drafts = min(MAX_DRAFT_TOKENS, capture_capacity) if head_pool is not None else 0
        self.context_length = context_length
        self.prefix_cache = prefix_cache
        self.uniform_drafts = False             # one draft count per step (rule 4)
        self._held_drafts: dict[str, int] | None = None    # plan_drafts' kept answer, by request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.releasing: dict[str, Request] = {}  # finished, pool space held for a step in flight
        self.num_preemptions = 0
        self.num_landed = 0                     # steps whose tokens were appended (the holds' clock)
        self.stats = SpecDecodeStats()          # every request's verified steps, summed

    # ------------------------------------------------------------------ requests
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.waiting_since = self.num_landed
        self.waiting.append(req)

    def is_live(self, req: Request) -> bool:
        """``req`` itself still runs or waits: not ended, and not a later request given its id
        (a step in flight still carries the rows of a request that ended under it)."""
        return self.requests.get(req.request_id) is req

    def finish(self, req: Request, reason: FinishReason, release: bool = True) -> None:
        """End a request (done or cancelled): out of the queues, every pool space released.
        ``release=False``: a launched step still writes its rows (overlapped decoding, see
        ``pipeline``): it keeps its pool space in ``releasing`` until ``release_finished``."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.status is RequestStatus.WAITING:   # never admitted, or preempted: it holds no pool space
            if self.prefix_cache is not None and req.request_id not in self.releasing:   # (nor its id's: an
                self.prefix_cache.forget_request(req.request_id)         # ended request's, under a step in flight)
        elif release:
            self._release_finished(req)
        else:
            self.releasing[req.request_id] = req
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]

    def release_finished(self, keep: set[str] = frozenset()) -> None:
        """Release the pool space of finished requests held back by ``finish(release=False)``,
        but for those in ``keep`` (rows of a step still in flight)."""
        for rid in [rid for rid in self.releasing if rid not in keep]:
            self._release_finished(self.releasing.pop(rid))

    def _release_finished(self, req: Request) -> None:
        self.release(req)
        if self.prefix_cache is not None:
            self.prefix_cache.forget_request(req.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning
    def admission_due(self) -> bool:
        """Whether the next step admits a waiting request (rule 2): one waits, a state row is
        free, and admissions are not held (``holds_admissions``)."""
        return bool(self.waiting) and self.state_bank.can_admit() and not self.holds_admissions()

    def carries_dead_rows(self, num_dead: int, num_rows: int) -> bool:
        """Whether a draft step's continuation may carry the ``num_dead`` rows (of its
        ``num_rows``) whose requests ended (``pipeline``): under uniform drafts (one captured
        shape; a dead row takes the step's K) while no waiting request could take their slots
        now: waiting requests are held (rule 2), or none waits and at most half the rows are
        dead. A slot nobody waits for stands empty anyway, and a stop costs a step launched
        alone; past half, most of the step's GPU time would go to rows whose tokens are dropped.
        (Over HTTP, or in an open loop, a finish's slot often has nobody waiting for it yet.)"""
        if not self.uniform_drafts:
            return False
        return self.holds_admissions() or (not self.waiting and 2 * num_dead <= num_rows)

    def holds_admissions(self) -> bool:
        """Whether waiting requests are held back (rule 2): MTP is on, ``admission_hold_steps`` is
        set, every running request decodes, the oldest has waited fewer than
        ``admission_hold_steps`` landed steps, and either fewer than ``admission_group`` per
        decoding request wait (at least one; at most a step's slots), or
        (``admission_lookahead``) a running request is expected to end within that many steps.
        (Neither is capped by the slots free now: a request that ends frees its slot, and in a
        closed loop its client sends the next one. When a step has as many slots as clients,
        as the bench's pools have, the slots free are just the requests that ended, so such a
        cap let every arrival in alone, and the lookahead never waited.)"""
        hold = self.config.admission_hold_steps
        if not hold or not self.max_drafts or not self.waiting:
            return False
        decoding = sum(1 for r in self.running if r.is_decoding)
        if decoding < len(self.running):         # a prompt step runs anyway (nothing running: the group is 1)
            return False
        if self.num_landed - min(r.waiting_since for r in self.waiting) >= hold:
            return False
        slots = self.config.max_requests_per_step
        if len(self.waiting) < min(max(1, math.ceil(self.config.admission_group * decoding)), slots):
            return True
        lookahead = self.config.admission_lookahead
        return bool(lookahead) and any(
            _ends_within(r, lookahead) for r in self.running)

    def schedule(self) -> StepPlan:
        """Plan one step and move the queues; pool space is reserved for everything scheduled."""
        plan = self._plan(self.running, list(self.waiting))
        for req in plan.preempted:
            self.running.remove(req)
        if plan.preempted:
            self.num_preemptions += len(plan.preempted)
            for req in plan.preempted:
                req.waiting_since = self.num_landed
            self.waiting.extend(plan.preempted)
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.arrival_index))
        return self._admitted(plan)

    def plan_prompts_beside(self, decoding: list[Request], admits: Callable[[Request], bool]) -> StepPlan | None:
        """The plan of a prompt step launched behind a draft step of ``decoding`` (the engine's
        ``prompt_continuations``), or None when no waiting request is admitted (nothing changes
        then): each of ``decoding`` feeds one row (the token that step emits last, at the
        position its acceptance leaves: the engine reserves its KV and moves it on the device),
        and waiting requests are admitted into the budget and slots left, as ``schedule`` admits
        them (rule 2, no preemption), in order until one that ``admits`` refuses. ``decoding``
        come first, in their order (the draft step's acceptance rows), then the admitted ones."""
        plan = StepPlan(scheduled=[ScheduledRequest(r, 1) for r in decoding])
        budget = self.config.max_tokens_per_step - len(decoding)
        slots = self.config.max_requests_per_step - len(decoding)
        self._admit_waiting(plan, list(itertools.takewhile(admits, self.waiting)), budget, slots)
        if not plan.admitted:
            return None
        return self._admitted(plan, first=len(decoding))

    def _admitted(self, plan: StepPlan, first: int = 0) -> StepPlan:
        """``plan``'s admissions moved from the queue, its requests packed in state-row order
        (but for its ``first`` requests, which stay first, in their order)."""
        for req in plan.admitted:
            self.waiting.remove(req)
            self.running.append(req)
        self.running.sort(key=lambda r: r.arrival_index)
        # packed in state-row order: a steady batch then reads and writes its bank rows in place
        plan.scheduled[first:] = sorted(plan.scheduled[first:], key=lambda s: self.state_bank.row(s.request.request_id))
        plan.layout = StepLayout.of(plan.scheduled)
        plan.request_ids = [s.request.request_id for s in plan.scheduled]
        return plan

    def _plan(self, running: list[Request], waiting: list[Request]) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_tokens_per_step
        slots = self.config.max_requests_per_step
        held = self.holds_admissions()
        has_prefill = any(not r.is_decoding for r in running) or (
            bool(waiting) and self.state_bank.can_admit() and not held)
        queue = list(running)
        wanted = self._wanted_drafts(running) if self.max_drafts and not has_prefill else {}
        while queue and budget > 0 and slots > 0:
            req = queue.pop(0)
            if req.is_decoding:
                num_tokens = 1
                k = wanted.get(req.request_id, 0)
                if self.uniform_drafts and k and budget < 1 + k:
                    continue          # rule 4: it waits for the next step rather than carry fewer drafts
                num_drafts = self._num_drafts(req, k, budget - 1) if k and not has_prefill else 0
            else:
                num_tokens, num_drafts = self._chunk(req, budget), 0
            num_drafts = self._reserve_or_preempt(req, num_tokens, num_drafts, queue, plan)
            if num_drafts is None:
                continue
            plan.scheduled.append(ScheduledRequest(req, num_tokens, num_drafts))
            budget -= num_tokens + num_drafts
            slots -= 1

        # rule 3 again: a preemption above can free the state row a waiting request needed, but
        # a step whose decodes already carry drafts admits no prompt chunk: it waits for one without
        if not held and not any(s.num_drafts for s in plan.scheduled):
            self._admit_waiting(plan, waiting, budget, slots)
        return plan

    def _admit_waiting(self, plan: StepPlan, waiting: list[Request], budget: int, slots: int) -> None:
        """Rule 2: ``waiting`` requests admitted into ``plan`` in order while a state row, KV,
        ``budget`` tokens and ``slots`` remain, each with the first chunk of its prompt."""
        for req in waiting:
            if budget <= 0 or slots <= 0 or not self.state_bank.can_admit():
                break
            if req.continues and self.prefix_cache is not None:   # before its lookup plans its snapshots
                self.prefix_cache.expect_continuation(req.request_id)
            hit = self._start_from_cache(req)
            num_tokens = self._chunk(req, budget)
            if not self._reserve(req, num_tokens, 0) or not self._reserve_head_prefix(req, hit):
                self._trim(exclude=plan)
                if not self._reserve(req, num_tokens, 0) or not self._reserve_head_prefix(req, hit):
                    self._undo_start(req)
                    break
            self.state_bank.admit(req.request_id)
            if self.prefix_cache is not None:
                if hit is not None:
                    self.state_bank.load_snapshot(req.request_id, hit.snapshot)
                    plan.prefix_hits[req.request_id] = hit
                self.prefix_cache.admitted(req.request_id, len(req.token_ids), hit)
            req.status = RequestStatus.RUNNING
            plan.admitted.append(req)
            plan.scheduled.append(ScheduledRequest(req, num_tokens, 0))
            budget -= num_tokens
            slots -= 1

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens of a prompt chunk: within the budget, ending on the request's next snapshot
        boundary when the prefix cache wants one there."""
        n = min(req.num_to_feed, budget)
        if self.prefix_cache is not None:
            boundary = self.prefix_cache.next_boundary(req.request_id, req.num_prompt_tokens, req.num_computed)
            if boundary is not None:
                n = min(n, boundary - req.num_computed)
        return n

    def _start_from_cache(self, req: Request) -> PrefixHit | None:
        """A waiting request's longest cached prefix: its main blocks attached, num_computed set."""
        if self.prefix_cache is None or req.params.prompt_logprobs is not None:   # it needs every prompt row
            return None
        hit = self.prefix_cache.lookup(req.request_id, req.token_ids)
        if hit is not None:
            self.kv_pool.attach(req.request_id, hit.blocks)
            req.num_computed = req.num_cached_tokens = hit.num_tokens
        return hit

    def _reserve_head_prefix(self, req: Request, hit: PrefixHit | None) -> bool:
        """After a hit: the head's shared blocks, fresh ones up to one block before the hit, so
        the head catches up on the hit's last block from the entry's hidden rows."""
        if hit is None or self.head_pool is None:
            return True
        rid, num_head = req.request_id, hit.num_tokens - self.kv_pool.block_size
        if rid not in self.head_pool:
            self.head_pool.attach(rid, hit.head_blocks)
        if not self.head_pool.reserve(rid, num_head):
            return False
        self.head_pool.commit(rid, num_head)
        req.num_head = num_head
        return True

    def _undo_start(self, req: Request) -> None:
        """Admission failed after a lookup: nothing is held, the request starts over later."""
        self.kv_pool.free(req.request_id)
        if self.head_pool is not None:
            self.head_pool.free(req.request_id)
        req.num_computed = req.num_head = req.num_cached_tokens = 0

    def _wanted_drafts(self, running: list[Request]) -> dict[str, int]:
        """Each decoding request's draft count before the caps, from the policy's plan for the
        step (``DraftPolicy.step_drafts``; one count for all under ``uniform_drafts``)."""
        decoding = [r for r in running if r.is_decoding]
        return dict(zip((r.request_id for r in decoding), self.plan_drafts(decoding)))

    def plan_drafts(self, decoding: list[Request]) -> list[int]:
        """The policy's draft counts for the next step of these decoding requests, asked once
        per step: the answer given to overlapped decoding's check (``pipeline``: whether a
        continuation is launched, and with which K) is kept when none is, and is the next
        schedule's when it plans the same requests, so a policy's turns (calibrating 0, 1, 0,
        ...) are not skipped."""
        held, self._held_drafts = self._held_drafts, None
        if held is not None and held.keys() == {r.request_id for r in decoding}:
            return [held[r.request_id] for r in decoding]
        return self.draft_policy.step_drafts(decoding, self.uniform_drafts)

    def hold_drafts(self, decoding: list[Request], wanted: list[int]) -> None:
        """Keep ``plan_drafts``' answer for the next schedule of the same requests."""
        self._held_drafts = dict(zip((r.request_id for r in decoding), wanted))

    def _num_drafts(self, req: Request, wanted: int, budget_left: int) -> int:
        context_left = self.context_length - len(req.token_ids)
        k = min(wanted, self.max_drafts, budget_left, context_left)
        if not self.uniform_drafts:       # rule 1: one K for all keeps a captured verify step
            k = min(k, req.max_output_left - 1)
        return max(0, k)

    def _reserve(self, req: Request, num_tokens: int, num_drafts: int) -> bool:
        """Main KV for every fed row; head KV for catch-up + chained rows when drafting."""
        rid = req.request_id
        if not self.kv_pool.reserve(rid, req.num_computed + num_tokens + num_drafts):
            return False
        if num_drafts and not self.head_pool.reserve(rid, req.num_computed + num_drafts - 1):
            return False
        return True

    def _reserve_or_preempt(self, req: Request, num_tokens: int, num_drafts: int,
                            unscheduled: list[Request], plan: StepPlan) -> int | None:
        """Reserve for `req`, making room if needed; the drafts granted, or None if `req` was preempted."""
        if self._reserve(req, num_tokens, num_drafts):
            return num_drafts
        self._trim(exclude=plan)
        while not self._reserve(req, num_tokens, num_drafts):
            if num_drafts:                       # first give up this step's drafts
                num_drafts = 0
                continue
            victim = unscheduled.pop() if unscheduled else req
            self.preempt(victim, plan)
            if victim is req:
                return None
        return num_drafts

    def _trim(self, exclude: StepPlan) -> None:
        """Hand back spare lookahead blocks of requests not scheduled in this plan."""
        scheduled = {s.request.request_id for s in exclude.scheduled}
        for pool in (self.kv_pool, self.head_pool):
            if pool is None:
                continue
            for rid in pool.request_ids:
                if rid not in scheduled:
                    pool.trim(rid)

    def preempt(self, req: Request, plan: StepPlan) -> None:
        """Free all of a running request's pool space; it will be recomputed from its tokens."""
        self.release(req)
        req.reset_for_recompute()
        if self.prefix_cache is not None:
            self.prefix_cache.preempted(req.request_id)
        plan.preempted.append(req)

    def release(self, req: Request) -> None:
        """Return a request's blocks and state row (finish, cancel or preempt)."""
        rid = req.request_id
        self.kv_pool.free(rid)
        if self.head_pool is not None:
            self.head_pool.free(rid)
        self.state_bank.release(rid)

    # ------------------------------------------------------------------ committing
    def update_from_output(self, plan: StepPlan, output: StepOutput) -> list[RequestUpdate]:
        """Commit a step: each request keeps its accepted rows (KV, head KV, state) and gets its
        emitted tokens appended up to the first stop id, max_tokens or the context end.

        A request that fed only part of its prompt keeps every row and emits nothing; one that
        sampled keeps its newest token plus the accepted drafts. The draft policy hears each
        verified step's (drafted, accepted) here. Finished requests are returned with a reason
        and still hold their pool space until ``finish``.
        """
        kept = []
        for s in plan.scheduled:
            n = s.num_tokens
            if s.samples and s.num_drafts:
                n = output.sampled[s.request.request_id][1] + 1
            kept.append(n)
        self.commit_rows(plan, output.present, kept, output.captures)
        return self.append_tokens(plan, output.sampled, kept)

    def commit_rows(self, plan: StepPlan, present: StepStates, num_kept: list[int],
                    captures: StepCaptures | None = None) -> None:
        """The pools keep request i's first ``num_kept[i]`` fed rows: the state bank's commit,
        then KV and head-KV lengths and ``num_computed``. A step without drafts keeps every fed
        row whatever it samples, so overlapped decoding commits it when it is launched."""
        self.state_bank.commit_step(plan.request_ids, present, [s.num_tokens + s.num_drafts for s in plan.scheduled],
                                    num_kept, captures)
        self._advance_lengths(list(zip(plan.scheduled, num_kept)))

    def commit_states_on_device(self, plan: StepPlan, present: StepStates, num_kept, captures: StepCaptures) -> None:
        """A launched draft step's state commit by its accepted counts ``num_kept`` (an array on
        the device the host has not read; every request fed 1 + K rows): the host's lengths
        follow with ``commit_lengths`` when it lands."""
        self.state_bank.commit_step_on_device(plan.request_ids, present, 1 + plan.scheduled[0].num_drafts,
                                              num_kept, captures)

    def commit_lengths(self, plan: StepPlan, num_kept: list[int], head_caught_up: bool) -> None:
        """The host's side of ``commit_states_on_device`` once the counts are read: state, KV and
        head-KV lengths and ``num_computed`` of every request still running (a dead row's go
        with its release). ``head_caught_up``: the next step's drafting already caught the head
        up on the kept rows (``num_head`` = ``num_computed``)."""
        live = [(s, k) for s, k in zip(plan.scheduled, num_kept) if self.is_live(s.request)]
        self.state_bank.advance_committed([s.request.request_id for s, _ in live], [k for _, k in live])
        self._advance_lengths(live, head_caught_up)

    def _advance_lengths(self, kept: list[tuple[ScheduledRequest, int]], head_caught_up: bool = False) -> None:
        """``num_computed`` and the KV length of each (scheduled request, rows kept), and a
        drafting request's head-KV length (``num_head``, = ``num_computed`` when the next step's
        drafting already caught the head up on the kept rows)."""
        for s, n in kept:
            r = s.request
            r.num_computed += n
            self.kv_pool.commit(r.request_id, r.num_computed)
            if s.num_drafts:
                if head_caught_up:
                    r.num_head = r.num_computed
                self.head_pool.commit(r.request_id, r.num_head)

    def append_tokens(self, plan: StepPlan, sampled: dict[str, tuple[list[int], int]],
                      num_kept: list[int]) -> list[RequestUpdate]:
        """Each sampling request's emitted tokens appended (up to a stop id or a limit), its
        counters and the draft policy told; one update per scheduled request. A request that
        finished since the step was launched (a dead row of overlapped decoding) gets none."""
        self.num_landed += 1
        updates, counts = [], []
        for s, kept in zip(plan.scheduled, num_kept):
            r = s.request
            u = RequestUpdate(r, [], kept)
            updates.append(u)
            if not s.samples or not self.is_live(r):
                continue
            emitted, num_accepted = sampled[r.request_id]
            if s.num_drafts:
                self.draft_policy.observe_verified(r.request_id, s.num_drafts, num_accepted)
            count = (s.num_drafts, num_accepted, len(emitted))
            r.stats.record_step(*count)
            counts.append(count)
            if emitted:
                u.new_token_ids, u.finish_reason = self._append_until_stop(r, emitted)
        self.stats.record_steps(counts)
        return updates

    def cache_prefixes(self, plan: StepPlan, pending_rows=None) -> None:
        """After a step's commit: the prefix cache enters the scheduled requests' newly full
        blocks and takes the snapshots due. ``pending_rows``: ``MTPProposer.pending_rows`` (MTP
        on), the main model's hidden rows a snapshot keeps for the head's catch-up."""
        if self.prefix_cache is None:
            return
        for s in plan.scheduled:
            r = s.request
            if not self.is_live(r):                    # finished: its entries go with its release
                continue
            # a stop id inside an accepted draft run leaves num_computed one past the kept tokens
            num_computed = min(r.num_computed, len(r.token_ids))
            self.prefix_cache.committed(r.request_id, r.token_ids, r.num_prompt_tokens, num_computed,
                                        min(r.num_head, num_computed), pending_rows)

    def _append_until_stop(self, req: Request, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append tokens up to and including the first stop id, or up to max_tokens / the context
        (at least one token: the step sampled it)."""
        room = max(1, min(req.max_output_left, self.context_length - len(req.token_ids)))
        added = tokens[:room]
        finish = FinishReason.LENGTH if room <= len(tokens) else None
        stops = req.stop_token_ids
        if stops:
            for i, t in enumerate(added):
                if t in stops:
                    added, finish = added[:i + 1], FinishReason.STOP
                    break
        req.token_ids.extend(added)
        return added, finish

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Every pool consistent; each running request's KV length equals its state length; no
        pool space held by a request that is not running."""
        self.kv_pool.check_integrity()
        self.state_bank.check_integrity()
        if self.head_pool is not None:
            self.head_pool.check_integrity()
        for r in self.running:
            kv, st = self.kv_pool.committed_len(r.request_id), self.state_bank.committed_len(r.request_id)
            assert kv == st == r.num_computed, (
                f"{r.request_id}: committed KV {kv}, state {st}, engine {r.num_computed}")
        resident = set(self.state_bank.request_ids)
        assert resident == {r.request_id for r in self.running} | set(self.releasing), (
            "state rows held by requests neither running nor finishing under a step in flight")
        assert set(self.kv_pool.request_ids) <= resident, "KV blocks held by non-resident requests"
        if self.head_pool is not None:
            assert set(self.head_pool.request_ids) <= resident, "head KV blocks held by non-resident requests"
        queued = {r.request_id for r in self.waiting} | {r.request_id for r in self.running}
        assert queued == set(self.requests), "a live request is in no queue, or a finished one still is"
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            self.prefix_cache.check_requests(set(self.requests) | set(self.releasing))

    def is_idle_and_empty(self) -> bool:
        """No requests, and every pool back to empty."""
        return (not self.has_work and not self.releasing and self.state_bank.num_resident_rows == 0
                and self.kv_pool.num_free_blocks == self.kv_pool.num_usable_blocks
                and (self.head_pool is None or self.head_pool.num_free_blocks == self.head_pool.num_usable_blocks))


def _ends_within(r: Request, steps: int) -> bool:
    """Whether request r is expected to reach its ``max_tokens`` within ``steps`` steps, at the
    tokens per step it has had so far (an end by a stop id cannot be foreseen)."""
    s = r.stats
    per_step = s.num_emitted_tokens / s.num_target_forwards if s.num_target_forwards else 1.0
    return r.max_output_left <= steps * max(1.0, per_step)
