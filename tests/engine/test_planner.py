"""The step planner on toy pools, no model: budget sharing, chunking, drafts, preemption."""
from __future__ import annotations

from mtpserve.engine.config import SchedulerConfig
from mtpserve.engine.kv_pool import KVPool
from mtpserve.engine.planner import StepPlanner
from mtpserve.engine.request import Request, RequestStatus
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.speculative import FixedDraftPolicy
from mtpserve.engine.state_bank import FixedLayerSpec, FixedStateSpec, StateBank

BS = 4
SPEC = FixedStateSpec((FixedLayerSpec(0, conv_dim=4, conv_kernel_size=4, num_v_heads=2, v_head_dim=2,
                                      num_k_heads=1, k_head_dim=2),), capacity=4)


def make(num_blocks=64, rows=8, budget=16, batch=8, k=3, mtp=True, context=4096, head_blocks=None):
    kv = KVPool(num_blocks, BS)
    head = KVPool(head_blocks or num_blocks, BS) if mtp else None
    bank = StateBank(SPEC, rows)
    planner = StepPlanner(SchedulerConfig(budget, batch), kv, head, bank, FixedDraftPolicy(k),
                          capture_capacity=4, context_length=context)
    return planner, kv, head, bank


def req(rid, n_prompt, max_tokens=100, arrival=0):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   arrival_index=arrival)


def commit(plan, kv, bank, head=None):
    """What the engine does after a step with every draft rejected: keep the fed real tokens,
    append one sampled token for requests that reached their end."""
    for s in plan.scheduled:
        r = s.request
        if s.num_drafts:
            r.num_head = r.num_computed
            head.commit(r.request_id, r.num_head)
        r.num_computed += s.num_tokens
        kv.commit(r.request_id, r.num_computed)
        bank._committed[bank.row(r.request_id)] = r.num_computed
        if s.samples:
            r.token_ids.append(7)


def test_decode_first_then_chunked_prefill_share_one_budget():
    planner, kv, head, bank = make(budget=16)
    a, b = req("a", 3, arrival=0), req("b", 30, arrival=1)
    plan = planner.plan([], [a, b])
    assert [(s.request.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 3), ("b", 13)]
    assert plan.admitted == [a, b] and a.status is RequestStatus.RUNNING
    commit(plan, kv, bank)
    # a decodes (drafts deferred: b is still mid-prefill), b gets the rest of the budget
    plan = planner.plan([a, b], [])
    assert [(s.request.request_id, s.num_tokens, s.num_drafts) for s in plan.scheduled] == [
        ("a", 1, 0), ("b", 15, 0)]
    assert not plan.scheduled[1].samples
    commit(plan, kv, bank)
    plan = planner.plan([a, b], [])
    assert [(s.num_tokens, s.num_drafts) for s in plan.scheduled] == [(1, 0), (2, 0)]
    assert plan.scheduled[1].samples
    commit(plan, kv, bank)
    # pure decode step: drafts allowed, reserved in both pools
    plan = planner.plan([a, b], [])
    assert [(s.num_tokens, s.num_drafts) for s in plan.scheduled] == [(1, 3), (1, 3)]
    for r in (a, b):
        assert len(kv.block_table(r.request_id)) * BS >= r.num_computed + 4
        assert len(head.block_table(r.request_id)) * BS >= r.num_computed + 2
    kv.check_integrity(); head.check_integrity(); bank.check_integrity()


def decoding(planner, kv, bank, *reqs):
    for r in reqs:
        commit(planner.plan([], [r]), kv, bank)
    return list(reqs)


def test_drafts_are_capped_by_capture_capacity_and_output_left():
    planner, kv, head, bank = make(k=5)                       # capacity 4 < 5 wanted
    a, b = decoding(planner, kv, bank, req("a", 2), req("b", 2, max_tokens=3, arrival=1))
    plan = planner.plan([a, b], [])
    # b has produced 1 of 3 tokens: a step may emit at most 2, so at most 1 draft
    assert [s.num_drafts for s in plan.scheduled] == [4, 1]


def test_drafts_are_capped_by_the_context_left():
    planner, kv, head, bank = make(k=4, context=12)
    a, b, c = decoding(planner, kv, bank, req("a", 8), req("b", 9, arrival=1), req("c", 10, arrival=2))
    plan = planner.plan([a, b, c], [])
    # a decode feeds its newest token at position len - 1, drafts at len .. len + K - 1 < context
    assert [s.num_drafts for s in plan.scheduled] == [3, 2, 1]
    for s in plan.scheduled:
        r = s.request
        assert r.num_computed + s.num_tokens + s.num_drafts <= 12
        assert len(kv.block_table(r.request_id)) * BS <= 12


def test_a_full_head_pool_drops_the_drafts_not_the_request():
    # the head pool holds 2 usable blocks of 4 slots: enough for a's catch-up and drafts, not b's too
    planner, kv, head, bank = make(k=3, budget=32, head_blocks=3)
    a, b = decoding(planner, kv, bank, req("a", 4), req("b", 4, arrival=1))
    plan = planner.plan([a, b], [])
    assert [(s.request.request_id, s.num_tokens, s.num_drafts) for s in plan.scheduled] == [
        ("a", 1, 3), ("b", 1, 0)]
    assert not plan.preempted and "b" not in head
    kv.check_integrity(); head.check_integrity(); bank.check_integrity()


def test_drafts_share_the_step_budget_with_decodes():
    planner, kv, head, bank = make(k=5, budget=8)
    reqs = decoding(planner, kv, bank, *[req(f"r{i}", 2, arrival=i) for i in range(3)])
    plan = planner.plan(reqs, [])
    # r0: 1 + 4 drafts; r1: 1 + the 2 tokens left; r2 waits for the next step
    assert [(s.request.request_id, s.num_drafts) for s in plan.scheduled] == [("r0", 4), ("r1", 2)]
    assert plan.num_tokens == 8


def test_mtp_off_never_drafts():
    planner, kv, head, bank = make(mtp=False, k=3)
    a = req("a", 2)
    commit(planner.plan([], [a]), kv, bank)
    assert planner.plan([a], []).scheduled[0].num_drafts == 0


def test_no_state_row_means_waiting_not_failing():
    planner, kv, head, bank = make(rows=2)
    reqs = [req(f"r{i}", 2, arrival=i) for i in range(4)]
    plan = planner.plan([], reqs)
    assert [r.request_id for r in plan.admitted] == ["r0", "r1"]
    assert reqs[2].status is RequestStatus.WAITING and "r2" not in kv


def test_pool_exhaustion_preempts_the_newest_running_request():
    # 6 usable blocks of 4 tokens = 24 slots; three requests of 8 tokens fill them
    planner, kv, head, bank = make(num_blocks=7, budget=32, mtp=False)
    reqs = [req(f"r{i}", 8, arrival=i) for i in range(3)]
    plan = planner.plan([], reqs)
    assert len(plan.admitted) == 3
    commit(plan, kv, bank)
    assert kv.num_free_blocks == 0
    # each now needs a 9th slot = a third block each; the oldest must win, the newest goes back
    plan = planner.plan(reqs, [])
    assert [r.request_id for r in plan.preempted] == ["r2"]
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].num_computed == 0
    assert "r2" not in kv and "r2" not in bank
    assert [s.request.request_id for s in plan.scheduled] == ["r0", "r1"]
    kv.check_integrity(); bank.check_integrity()


def test_a_request_that_cannot_fit_alone_preempts_itself_instead_of_looping():
    planner, kv, head, bank = make(num_blocks=3, budget=32, mtp=False)   # 2 usable blocks = 8 slots
    a = req("a", 8)
    commit(planner.plan([], [a]), kv, bank)
    plan = planner.plan([a], [])
    assert plan.preempted == [a] and not plan.scheduled
    kv.check_integrity(); bank.check_integrity()
