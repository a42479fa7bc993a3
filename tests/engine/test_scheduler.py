"""The scheduler on toy pools, no model: budget sharing, chunking, drafts, preemption, and the
commit of a step from hand-built outputs (what the forward and the acceptance would return)."""
from __future__ import annotations

import numpy as np

from mtpserve.engine.config import SchedulerConfig
from mtpserve.engine.draft_policy import FixedDraftPolicy
from mtpserve.engine.kv_pool import KVPool
from mtpserve.engine.request import FinishReason, Request, RequestStatus
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.scheduler import Scheduler, StepOutput
from mtpserve.engine.state_bank import FixedLayerSpec, FixedStateSpec, StateBank, StepCaptures

BS = 4
LAYER = FixedLayerSpec(0, conv_dim=4, conv_kernel_size=4, num_v_heads=2, v_head_dim=2, num_k_heads=1, k_head_dim=2)
SPEC = FixedStateSpec((LAYER,), capacity=4)


class RecordingPolicy(FixedDraftPolicy):
    """A fixed K that keeps what the scheduler reports of each verified step."""

    def __init__(self, k):
        super().__init__(k)
        self.verified = []

    def observe_verified(self, request_id, num_drafts, num_accepted):
        self.verified.append((request_id, num_drafts, num_accepted))


def make(num_blocks=64, rows=8, budget=16, batch=8, k=3, mtp=True, context=4096, head_blocks=None, hold=0, group=0.25,
         lookahead=0):
    kv = KVPool(num_blocks, BS)
    head = KVPool(head_blocks or num_blocks, BS) if mtp else None
    bank = StateBank(SPEC, rows)
    config = SchedulerConfig(budget, batch, admission_hold_steps=hold, admission_group=group,
                             admission_lookahead=lookahead)
    sched = Scheduler(config, kv, head, bank, RecordingPolicy(k),
                      capture_capacity=4, context_length=context)
    return sched, kv, head, bank


def req(rid, n_prompt, max_tokens=100, arrival=0, stop_token_ids=frozenset()):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   arrival_index=arrival, stop_token_ids=frozenset(stop_token_ids))


def outputs(plan, accepted=None, tokens=(7, 8, 9, 10, 11, 12, 13, 14)):
    """Hand-built step outputs: each sampling request accepts accepted[rid] drafts (default 0) and
    emits tokens[:accepted + 1]; zero present states and captures of the step's shape."""
    accepted = accepted or {}
    sampled = {}
    for s in plan.scheduled:
        if s.samples:
            a = accepted.get(s.request.request_id, 0)
            assert a <= s.num_drafts
            sampled[s.request.request_id] = (list(tokens[:a + 1]), a)
        if s.num_drafts:                      # the proposer's catch-up ran up to num_computed
            s.request.num_head = s.request.num_computed
    b, c = len(plan.scheduled), SPEC.capacity
    captures = StepCaptures(SPEC.layer_ids, np.zeros((1, b, c, LAYER.conv_dim), np.float32),
                            np.zeros((1, b, c * LAYER.capsule_width_per_token), np.float32))
    return StepOutput(sampled, SPEC.zero_states(b), captures)


def step(sched, accepted=None):
    """Schedule, commit with hand-built outputs, finish what finished; (plan, updates)."""
    plan = sched.schedule()
    updates = sched.update_from_output(plan, outputs(plan, accepted))
    for u in updates:
        if u.finish_reason is not None:
            sched.finish(u.request, u.finish_reason)
    sched.check_integrity()
    return plan, updates


def decoding(sched, *reqs):
    """Add the requests and run their prompts in one step: each then decodes."""
    for r in reqs:
        sched.add(r)
    step(sched)
    assert all(r.is_decoding for r in reqs)
    return list(reqs)


def test_decode_first_then_chunked_prefill_share_one_budget():
    sched, kv, head, bank = make(budget=16)
    a, b = req("a", 3, arrival=0), req("b", 30, arrival=1)
    sched.add(a), sched.add(b)
    plan, _ = step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 3), ("b", 13)]
    assert plan.admitted == [a, b] and a.status is RequestStatus.RUNNING
    # a decodes (drafts deferred: b is still mid-prefill), b gets the rest of the budget
    plan, _ = step(sched)
    assert [(s.request.request_id, s.num_tokens, s.num_drafts) for s in plan.scheduled] == [
        ("a", 1, 0), ("b", 15, 0)]
    assert not plan.scheduled[1].samples
    plan, _ = step(sched)
    assert [(s.num_tokens, s.num_drafts) for s in plan.scheduled] == [(1, 0), (2, 0)]
    assert plan.scheduled[1].samples
    # pure decode step: drafts allowed, reserved in both pools
    plan = sched.schedule()
    assert [(s.num_tokens, s.num_drafts) for s in plan.scheduled] == [(1, 3), (1, 3)]
    for r in (a, b):
        assert len(kv.block_table(r.request_id)) * BS >= r.num_computed + 4
        assert len(head.block_table(r.request_id)) * BS >= r.num_computed + 2
    for pool in (kv, head, bank):
        pool.check_integrity()


def test_the_layout_places_each_request_s_rows_once():
    sched, kv, head, bank = make(budget=32)
    decoding(sched, req("a", 2), req("b", 2, arrival=1), req("c", 2, max_tokens=4, arrival=2))
    sched.add(req("d", 5, arrival=3))
    plan, _ = step(sched)            # d's prefill defers every draft
    assert [s.num_tokens + s.num_drafts for s in plan.scheduled] == [1, 1, 1, 5]
    assert plan.layout.row_start == [0, 1, 2, 3] and plan.layout.target_row == [0, 1, 2, 7]
    plan, _ = step(sched)            # a, b, d draft 3; c (2 of 4 tokens left) 1
    assert [(s.request.request_id, s.num_tokens, s.num_drafts) for s in plan.scheduled] == [
        ("a", 1, 3), ("b", 1, 3), ("c", 1, 1), ("d", 1, 3)]
    assert plan.layout.row_start == [0, 4, 8, 10]
    assert plan.layout.num_rows == [4, 4, 2, 4]
    assert plan.layout.target_row == [0, 4, 8, 10]


def test_commit_keeps_the_accepted_drafts_plus_one_and_appends_what_was_emitted():
    sched, kv, head, bank = make(k=3)
    a, b, c = decoding(sched, req("a", 5), req("b", 5, arrival=1), req("c", 5, arrival=2))
    before = {r.request_id: (r.num_computed, len(r.token_ids)) for r in (a, b, c)}
    plan = sched.schedule()
    assert all(s.num_drafts == 3 for s in plan.scheduled)
    updates = sched.update_from_output(plan, outputs(plan, {"a": 0, "b": 2, "c": 3}))
    for u, accepted in zip(updates, (0, 2, 3)):
        r = u.request
        computed, length = before[r.request_id]
        assert u.num_kept == accepted + 1 and u.finish_reason is None
        assert u.new_token_ids == [7, 8, 9, 10][:accepted + 1]
        assert r.num_computed == computed + accepted + 1 and len(r.token_ids) == length + accepted + 1
        assert kv.committed_len(r.request_id) == bank.committed_len(r.request_id) == r.num_computed
        assert head.committed_len(r.request_id) == r.num_head == computed
        assert r.stats.num_accepted_tokens == accepted and r.stats.num_draft_tokens == 3
    assert sched.draft_policy.verified == [("a", 3, 0), ("b", 3, 2), ("c", 3, 3)]
    assert sched.stats.num_draft_tokens == 9 and sched.stats.num_accepted_tokens == 5
    sched.check_integrity()


def test_commit_cuts_at_a_stop_id_inside_the_accepted_run_and_at_max_tokens():
    sched, kv, head, bank = make(k=3)
    a = req("a", 5, stop_token_ids={8})
    b = req("b", 5, max_tokens=3, arrival=1)
    decoding(sched, a, b)              # each has emitted 7
    plan = sched.schedule()
    assert [s.num_drafts for s in plan.scheduled] == [3, 1]     # b may emit 2 more tokens
    updates = sched.update_from_output(plan, outputs(plan, {"a": 3, "b": 1}))
    assert [(u.new_token_ids, u.finish_reason) for u in updates] == [
        ([7, 8], FinishReason.STOP), ([7, 8], FinishReason.LENGTH)]
    assert a.token_ids[5:] == [7, 7, 8] and b.num_output_tokens == 3
    assert a.stats.num_emitted_tokens == 1 + 4, "stats count what the step emitted before the cut"
    for u in updates:
        sched.finish(u.request, u.finish_reason)
    sched.check_integrity()
    assert sched.is_idle_and_empty() and a.status is RequestStatus.FINISHED


def test_a_prefill_chunk_keeps_every_row_and_emits_nothing():
    sched, kv, head, bank = make(budget=8)
    a = req("a", 20)
    sched.add(a)
    plan = sched.schedule()
    updates = sched.update_from_output(plan, outputs(plan))
    assert [(u.num_kept, u.new_token_ids) for u in updates] == [(8, [])]
    assert a.num_computed == 8 == kv.committed_len("a") == bank.committed_len("a")
    assert a.stats.num_target_forwards == 0


def test_drafts_are_capped_by_capture_capacity_and_output_left():
    sched, kv, head, bank = make(k=5)                       # capacity 4 < 5 wanted
    a, b = decoding(sched, req("a", 2), req("b", 2, max_tokens=3, arrival=1))
    plan = sched.schedule()
    # b has produced 1 of 3 tokens: a step may emit at most 2, so at most 1 draft
    assert [s.num_drafts for s in plan.scheduled] == [4, 1]


def test_drafts_are_capped_by_the_context_left():
    sched, kv, head, bank = make(k=4, context=12, budget=32)
    a, b, c = decoding(sched, req("a", 8), req("b", 9, arrival=1), req("c", 10, arrival=2))
    plan = sched.schedule()
    # a decode feeds its newest token at position len - 1, drafts at len .. len + K - 1 < context
    assert [s.num_drafts for s in plan.scheduled] == [3, 2, 1]
    for s in plan.scheduled:
        r = s.request
        assert r.num_computed + s.num_tokens + s.num_drafts <= 12
        assert len(kv.block_table(r.request_id)) * BS <= 12


def test_a_full_head_pool_drops_the_drafts_not_the_request():
    # the head pool holds 2 usable blocks of 4 slots: enough for a's catch-up and drafts, not b's too
    sched, kv, head, bank = make(k=3, budget=32, head_blocks=3)
    a, b = decoding(sched, req("a", 4), req("b", 4, arrival=1))
    plan = sched.schedule()
    assert [(s.request.request_id, s.num_tokens, s.num_drafts) for s in plan.scheduled] == [
        ("a", 1, 3), ("b", 1, 0)]
    assert not plan.preempted and "b" not in head
    for pool in (kv, head, bank):
        pool.check_integrity()


def test_drafts_share_the_step_budget_with_decodes():
    sched, kv, head, bank = make(k=5, budget=8)
    decoding(sched, *[req(f"r{i}", 2, arrival=i) for i in range(3)])
    plan = sched.schedule()
    # r0: 1 + 4 drafts; r1: 1 + the 2 tokens left; r2 waits for the next step
    assert [(s.request.request_id, s.num_drafts) for s in plan.scheduled] == [("r0", 4), ("r1", 2)]
    assert plan.num_tokens == 8


def test_mtp_off_never_drafts():
    sched, kv, head, bank = make(mtp=False, k=3)
    decoding(sched, req("a", 2))
    assert sched.schedule().scheduled[0].num_drafts == 0


def test_no_state_row_means_waiting_not_failing():
    sched, kv, head, bank = make(rows=2)
    reqs = [req(f"r{i}", 2, arrival=i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert [r.request_id for r in plan.admitted] == ["r0", "r1"]
    assert reqs[2].status is RequestStatus.WAITING and "r2" not in kv
    assert list(sched.waiting) == reqs[2:]


def test_pool_exhaustion_preempts_the_newest_running_request():
    # 6 usable blocks of 4 tokens = 24 slots; three requests of 8 tokens fill them
    sched, kv, head, bank = make(num_blocks=7, budget=32, mtp=False)
    reqs = [req(f"r{i}", 8, arrival=i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert len(plan.admitted) == 3
    sched.update_from_output(plan, outputs(plan))
    assert kv.num_free_blocks == 0
    # each now needs a 9th slot = a third block each; the oldest must win, the newest goes back
    plan = sched.schedule()
    assert [r.request_id for r in plan.preempted] == ["r2"]
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].num_computed == 0
    assert "r2" not in kv and "r2" not in bank and list(sched.waiting) == [reqs[2]]
    assert [s.request.request_id for s in plan.scheduled] == ["r0", "r1"]
    assert sched.num_preemptions == 1
    for pool in (kv, bank):
        pool.check_integrity()


def test_a_request_that_cannot_fit_alone_preempts_itself_instead_of_looping():
    sched, kv, head, bank = make(num_blocks=3, budget=32, mtp=False)   # 2 usable blocks = 8 slots
    a = req("a", 8)
    sched.add(a)
    plan = sched.schedule()
    sched.update_from_output(plan, outputs(plan))
    plan = sched.schedule()
    assert plan.preempted == [a] and not plan.scheduled
    for pool in (kv, bank):
        pool.check_integrity()


def test_finish_releases_everything_from_either_queue():
    sched, kv, head, bank = make(rows=1)
    a, b = req("a", 3), req("b", 3, arrival=1)
    sched.add(a), sched.add(b)
    step(sched)                              # a runs, b waits for the one state row
    sched.finish(b, FinishReason.ABORT)
    sched.finish(a, FinishReason.ABORT)
    assert sched.is_idle_and_empty() and not sched.requests
    sched.check_integrity()


def test_a_row_freed_by_preemption_admits_no_prompt_beside_drafts():
    """Rule 3 when a preemption frees the state row a waiting request needed: that request waits
    for a step without drafts instead of feeding its prompt beside them (it was admitted into
    such a step: a mixed step whose drafts ORT's CUDA kernels give no per-token captures for)."""
    sched, kv, head, bank = make(num_blocks=6, rows=2, budget=32, k=3)
    a, b = decoding(sched, req("a", 8, max_tokens=12, arrival=0), req("b", 8, arrival=1))
    c = req("c", 5, arrival=2)
    sched.add(c)                                   # no row free: the step plans drafts
    plan, _ = step(sched)
    assert plan.preempted == [b], "a's drafts need b's blocks"
    assert [(s.request.request_id, s.num_drafts) for s in plan.scheduled] == [("a", 3)]
    assert not plan.admitted and not any(s.num_tokens > 1 for s in plan.scheduled)
    admitted = []
    for _ in range(20):                            # a ends; b (first in line again), then c, go in
        plan, _ = step(sched)
        assert not (plan.admitted and any(s.num_drafts for s in plan.scheduled)), "a prompt beside drafts"
        admitted += plan.admitted
        if not sched.running and not sched.waiting:
            break
    assert admitted[:2] == [b, c]


def test_held_arrivals_join_one_prompt_step_within_the_hold():
    """Rule 2's hold: while 4 requests decode, one arrival waits (their steps keep drafting) until
    a second joins it (group 0.5 x 4 = 2), then both feed their prompts in one step."""
    sched, kv, head, bank = make(budget=64, hold=5, group=0.5, k=2)
    decoding(sched, *(req(f"r{i}", 3, arrival=i) for i in range(4)))
    e = req("e", 5, arrival=4)
    sched.add(e)
    for _ in range(2):
        assert not sched.admission_due()
        plan, _ = step(sched)
        assert not plan.admitted and all(s.num_drafts == 2 for s in plan.scheduled), "held: a drafting step"
    f = req("f", 6, arrival=5)
    sched.add(f)
    assert sched.admission_due()
    plan, _ = step(sched)
    assert plan.admitted == [e, f] and not any(s.num_drafts for s in plan.scheduled)


def test_arrivals_are_held_when_a_step_has_as_many_slots_as_clients():
    """Rule 2's group with 4 slots a step and 4 clients (the bench's pools: as many slots and
    rows as requests in flight): a request ends, its client's next one arrives into the one free
    slot and is held (group 0.5 x 3 decoding = 2) until a second ending brings another; both
    then feed their prompts in one step."""
    sched, kv, head, bank = make(budget=64, rows=4, batch=4, hold=6, group=0.5, k=2)
    a, b, c, d = decoding(sched, req("a", 3, max_tokens=2), req("b", 3, max_tokens=5, arrival=1),
                          req("c", 3, arrival=2), req("d", 3, arrival=3))
    arrivals, admitted = iter([req("e", 4, arrival=4), req("f", 5, arrival=5)]), []
    for _ in range(6):
        plan, updates = step(sched)
        admitted.append([r.request_id for r in plan.admitted])
        for u in updates:
            if u.finish_reason is not None:
                sched.add(next(arrivals))          # its client comes back
        if not sched.waiting and len(sched.running) == 4:
            break
    assert [x for x in admitted if x] == [["e", "f"]], f"arrivals admitted {admitted}"
    for pool in (kv, head, bank):
        pool.check_integrity()


def test_a_held_arrival_is_admitted_after_the_hold_and_at_once_when_nothing_decodes():
    sched, kv, head, bank = make(budget=64, hold=3, group=0.5)
    a = req("a", 3)
    sched.add(a)
    assert sched.admission_due(), "nothing decodes: no hold"
    decoding(sched, req("b", 3, arrival=1), req("c", 3, arrival=2))      # (a went in with them)
    d = req("d", 3, arrival=3)
    sched.add(d)                          # alone beside 3 decoding (group 2): held for 3 landed steps
    steps = 0
    while d.status is RequestStatus.WAITING:
        plan, _ = step(sched)
        steps += 1
        assert steps <= 4, "held past its hold"
    assert steps == 4 and plan.admitted == [d], "held for 3 landed steps, admitted in the 4th"
    for pool in (kv, head, bank):
        pool.check_integrity()


def test_a_gathered_group_waits_for_a_request_about_to_end_within_the_hold():
    """Rule 2's lookahead: 2 arrivals beside 4 decoding requests make a group (0.5 x 4), but d
    reaches its max_tokens within 2 steps (one token a step so far), so they wait for d's end
    and the arrival it brings, and all three feed their prompts in one step. Without the
    lookahead the group goes in at once; with a hold of 1 step the lookahead waits 1 step; with
    6 slots a step (the 2 waiting fill the slots free now) it still waits: d's end frees its
    slot for the arrival it brings."""
    for lookahead, hold, batch, expect_held in ((2, 6, 8, 2), (0, 6, 8, 0), (2, 1, 8, 1), (2, 6, 6, 2)):
        sched, kv, head, bank = make(budget=64, batch=batch, hold=hold, group=0.5, k=2, lookahead=lookahead)
        decoding(sched, *(req(f"r{i}", 3, arrival=i) for i in range(3)), req("d", 3, max_tokens=3, arrival=3))
        e, f = req("e", 4, arrival=4), req("f", 5, arrival=5)
        sched.add(e), sched.add(f)
        held = 0
        while not sched.admission_due():
            plan, updates = step(sched)
            assert not plan.admitted
            held += 1
            if any(u.request.request_id == "d" and u.finish_reason is not None for u in updates):
                sched.add(req("g", 6, arrival=6))        # d's client comes back
        assert held == expect_held, (lookahead, hold, held)
        plan, _ = step(sched)
        assert [r.request_id for r in plan.admitted] == (["e", "f", "g"] if held == 2 else ["e", "f"])
        for pool in (kv, head, bank):
            pool.check_integrity()


def test_an_arrival_beside_a_prompt_still_feeding_is_not_held():
    """Rule 2: while a running request still feeds its prompt, the step is a prompt step anyway,
    so an arrival joins it at once (group 1.0: it would be held beside 2 decoding requests)."""
    sched, kv, head, bank = make(budget=32, hold=8, group=1.0)
    for r in (req("b", 3), req("c", 3, arrival=1), req("long", 40, arrival=2)):
        sched.add(r)
    step(sched)                          # b and c decode next; long has 14 prompt tokens left
    d = req("d", 3, arrival=3)
    sched.add(d)
    assert sched.admission_due()
    plan, _ = step(sched)
    assert d in plan.admitted
