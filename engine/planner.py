"""The step planner: which requests run this step, with how many tokens and drafts.

One token budget and one batch limit are shared by prefill chunks, decodes and drafts:

1. Running requests first, oldest first (decode-first): a decoding request feeds its newest
   token plus K drafts (K from the draft policy, capped by min(7, capture capacity, the step's
   budget left, its output budget left, the context left)); a running request still in its
   prompt feeds the next chunk of it.
2. Then waiting requests, oldest first, are admitted while a state row, KV blocks, budget and
   batch slots remain; each feeds the first chunk of its prompt (chunked prefill).
3. Drafts are deferred (K = 0) in a step that carries any prefill chunk: the captures of such a
   step are not valid for rollback (DESIGN §3).

Reservations are all-or-nothing per request: main KV for everything the step feeds, the MTP
head's KV for its catch-up and chained rows. When the pools run out the planner first trims
the unscheduled requests' spare lookahead, then preempts the newest running request (frees
everything, requeues it for recompute) instead of failing anyone. Admissions never preempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtpserve.engine.config import MAX_DRAFT_TOKENS, SchedulerConfig
from mtpserve.engine.kv_pool import KVPool
from mtpserve.engine.request import Request, RequestStatus
from mtpserve.engine.speculative import DraftPolicy
from mtpserve.engine.state_bank import StateBank


@dataclass
class ScheduledRequest:
    """One request's part of a step."""
    request: Request
    num_tokens: int          # tokens fed from request.token_ids[num_computed:]
    num_drafts: int = 0      # draft rows appended after them (verified this step)
    samples: bool = field(init=False)   # the step reaches the end of the tokens: new tokens come out

    def __post_init__(self) -> None:
        self.samples = self.num_tokens == self.request.num_to_feed


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens + s.num_drafts for s in self.scheduled)


class StepPlanner:
    """Plans steps over the engine's pools; owns no requests (the engine keeps the queues)."""

    def __init__(self, config: SchedulerConfig, kv_pool: KVPool, head_pool: KVPool | None,
                 state_bank: StateBank, draft_policy: DraftPolicy, capture_capacity: int,
                 context_length: int):
        self.config = config
        self.kv_pool = kv_pool
        self.head_pool = head_pool
        self.state_bank = state_bank
        self.draft_policy = draft_policy
        self.max_drafts = min(MAX_DRAFT_TOKENS, capture_capacity) if head_pool is not None else 0
        self.context_length = context_length

    def plan(self, running: list[Request], waiting: list[Request]) -> StepPlan:
        """Plan one step. `running` is oldest first; `waiting` is in admission order.

        Reserves pool space for everything scheduled; preempted requests are freed here and
        returned for the engine to requeue.
        """
        plan = StepPlan()
        budget = self.config.max_tokens_per_step
        slots = self.config.max_requests_per_step
        has_prefill = any(not r.is_decoding for r in running) or (
            bool(waiting) and self.state_bank.can_admit())
        queue = list(running)
        while queue and budget > 0 and slots > 0:
            req = queue.pop(0)
            if req.is_decoding:
                num_tokens = 1
                num_drafts = 0 if has_prefill else self._num_drafts(req, budget - 1)
            else:
                num_tokens, num_drafts = min(req.num_to_feed, budget), 0
            num_drafts = self._reserve_or_preempt(req, num_tokens, num_drafts, queue, plan)
            if num_drafts is None:
                continue
            plan.scheduled.append(ScheduledRequest(req, num_tokens, num_drafts))
            budget -= num_tokens + num_drafts
            slots -= 1

        for req in waiting:
            if budget <= 0 or slots <= 0 or not self.state_bank.can_admit():
                break
            num_tokens = min(req.num_to_feed, budget)
            if not self._reserve(req, num_tokens, 0):
                self._trim(exclude=plan)
                if not self._reserve(req, num_tokens, 0):
                    self.kv_pool.free(req.request_id)
                    break
            self.state_bank.admit(req.request_id)
            req.status = RequestStatus.RUNNING
            plan.admitted.append(req)
            plan.scheduled.append(ScheduledRequest(req, num_tokens, 0))
            budget -= num_tokens
            slots -= 1
        return plan

    # ------------------------------------------------------------------ helpers
    def _num_drafts(self, req: Request, budget_left: int) -> int:
        wanted = self.draft_policy.num_drafts(req) if self.max_drafts else 0
        context_left = self.context_length - len(req.token_ids)
        return max(0, min(wanted, self.max_drafts, budget_left, req.max_output_left - 1, context_left))

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
        plan.preempted.append(req)

    def release(self, req: Request) -> None:
        """Return a request's blocks and state row (finish, cancel or preempt)."""
        rid = req.request_id
        self.kv_pool.free(rid)
        if self.head_pool is not None:
            self.head_pool.free(rid)
        self.state_bank.release(rid)
