"""Overlapped decoding (engine/pipeline.py) on the bundled model: a decode step launched before the
tokens of the step it follows are read gives the same tokens, events and pools as stepping one
step at a time, through finishes, cancels, arrivals, preemption and requests it must not overlap.

On the CPU nothing runs in parallel (overlap_decode is off by default there); these tests turn it
on to run the same bookkeeping the CUDA path runs: commit at launch, dead rows, late releases.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from mtpserve.engine.draft_policy import DraftPolicy
from mtpserve.engine.engine import Engine
from mtpserve.engine.request import FinishReason
from mtpserve.engine.sampler import SamplingParams

from test_engine import PROMPTS


def make(model_dir, overlap: bool, num_blocks=512, max_rows=16, budget=48, batch=16, k=0,
         max_model_len=None, synthetic=None, uniform=False, hold=0, lookahead=0, prompt_graphs=False) -> Engine:
    """``uniform``: the scheduler plans one K for every request of a step, as with CUDA graphs;
    ``hold``: admission_hold_steps (CUDA's default holds arrivals; the CPU's does not);
    ``lookahead``: admission_lookahead; ``prompt_graphs``: prompt steps through varlen bindings."""
    engine = Engine(EngineConfig(str(model_dir), num_threads=2, overlap_decode=overlap, max_model_len=max_model_len,
                                 prompt_graphs=prompt_graphs,
                               cache=CacheConfig(num_blocks=num_blocks, max_resident_requests=max_rows),
                               scheduler=SchedulerConfig(max_tokens_per_step=budget, max_requests_per_step=batch,
                                                         admission_hold_steps=hold,
                                                         admission_lookahead=lookahead),
                               spec=SpecConfig(draft_tokens=k, synthetic_acceptance=synthetic)))
    engine.scheduler.uniform_drafts = engine.scheduler.uniform_drafts or uniform
    return engine


def run(engine: Engine, requests: list[tuple[str, object, SamplingParams]], during=None):
    """Add ``requests`` (id, prompt, params), step to the end with the pools checked after every
    step, ``during(engine, step_index)`` after each; (tokens, finish reasons, text) by id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    tokens, reasons, text = {}, {}, {}
    i = 0
    while engine.has_work:
        for ev in engine.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            text[ev.request_id] = text.get(ev.request_id, "") + ev.text
            if ev.finish_reason is not None:
                assert ev.request_id not in reasons, f"{ev.request_id} finished twice"
                reasons[ev.request_id] = ev.finish_reason
        engine.check_integrity()
        if during is not None:
            during(engine, i)
        i += 1
    assert engine.is_idle_and_empty(), "pools not back to empty after every request finished"
    return tokens, reasons, text


def both(model_dir, requests, **kw):
    """The same requests on an engine stepping one step at a time and on an overlapping one."""
    plain = run(make(model_dir, False, **kw), requests)
    engine = make(model_dir, True, **kw)
    return plain, run(engine, requests), engine


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def arriving(requests: list, steps: tuple[int, ...]):
    """A ``run`` hook adding ``requests[j]`` (id, prompt, params) after step ``steps[j]``."""
    def arrive(e, i):
        if i in steps:
            e.add_request(*requests[steps.index(i)])
    return arrive


def test_greedy_tokens_equal_stepping_one_at_a_time_with_chunked_prefill_and_batching(model_dir):
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    plain, overlapped, engine = both(model_dir, requests)
    assert overlapped == plain
    # most decode steps were launched before their predecessor landed
    assert engine.num_continuations > 0.5 * engine.num_steps, (engine.num_continuations, engine.num_steps,
                                                               engine.overlap_blockers)


def test_stop_ids_stop_strings_and_max_tokens_end_requests_under_a_step_in_flight(model_dir):
    probe = make(model_dir, False)
    text = run(probe, [("p", PROMPTS[2], GREEDY)])[2]["p"]
    ids = probe.tokenizer.encode(text)
    requests = [  # each ends at a different step, while its continuation is in flight
        ("stop-string", PROMPTS[2], dataclasses.replace(GREEDY, stop=[text[12:15]])),
        ("stop-id", PROMPTS[2], dataclasses.replace(GREEDY, stop_token_ids=[ids[7]])),
        ("eos", PROMPTS[3], SamplingParams(temperature=0, max_tokens=40)),
        *((f"len{n}", PROMPTS[4 + n], dataclasses.replace(GREEDY, max_tokens=n)) for n in (1, 2, 3, 9)),
    ]
    plain, overlapped, engine = both(model_dir, requests)
    assert overlapped == plain
    assert plain[1]["stop-string"] == plain[1]["stop-id"] == FinishReason.STOP
    assert [len(plain[0][f"len{n}"]) for n in (1, 2, 3, 9)] == [1, 2, 3, 9]
    assert engine.num_continuations > 0


def test_requests_reaching_the_context_end_under_a_step_in_flight_end_there(model_dir):
    requests = [(f"r{i}", p, dataclasses.replace(GREEDY, max_tokens=200)) for i, p in enumerate(PROMPTS[:6])]
    plain, overlapped, engine = both(model_dir, requests, max_model_len=64)
    assert overlapped == plain
    assert set(plain[1].values()) == {FinishReason.LENGTH}
    assert all(len(engine.tokenizer.encode(p)) + len(plain[0][rid]) == 64 for rid, p, _ in requests)
    assert engine.num_continuations > 0


def test_a_cancel_under_a_step_in_flight_releases_its_row_when_that_step_lands(model_dir):
    requests = [("a", PROMPTS[0], GREEDY), ("b", PROMPTS[1], GREEDY), ("c", PROMPTS[5], GREEDY)]
    plain = run(make(model_dir, False), requests)
    engine = make(model_dir, True)
    seen = {}

    def cancel(e, i):
        if i == 8:
            assert e._in_flight is not None and "b" in e._in_flight.plan.request_ids
            rows = e.state_bank.num_free_rows
            assert e.abort("b").finish_reason == FinishReason.ABORT
            assert e.abort("b") is None                       # once
            assert e.state_bank.num_free_rows == rows          # its row is still written by the launched step
            seen["rows"] = rows
        if i == 9:
            assert e.state_bank.num_free_rows == seen["rows"] + 1
    tokens, reasons, _ = run(engine, requests, during=cancel)
    assert "b" not in reasons and len(tokens["b"]) < len(plain[0]["b"])
    assert tokens["b"] == plain[0]["b"][:len(tokens["b"])]
    assert {r: tokens[r] for r in "ac"} == {r: plain[0][r] for r in "ac"}



def test_a_cancel_and_reuse_of_its_id_between_a_prompt_step_and_its_continuation_keep_every_token(model_dir):
    """With MTP on a prompt step lands before its continuation is launched (at the next step
    call): a client that cancels right after its first token, and sends a new request under the
    same id, leaves that continuation unlaunched; the new request gets only its own tokens, the
    other request stepping's, and the pools stay intact (``run`` checks them every step)."""
    requests = [("a", PROMPTS[0], GREEDY), ("b", PROMPTS[1], GREEDY)]
    plain = run(make(model_dir, False, k=2, uniform=True), requests)[0]
    alone = run(make(model_dir, False, k=2, uniform=True), [("b", PROMPTS[7], GREEDY)])[0]["b"]
    engine = make(model_dir, True, k=2, uniform=True)
    engine.draft_after_decode = True
    reused = {}

    def cancel_and_reuse(e, i):
        if i == 0:
            assert e._landed_prompt is not None and e._in_flight is None, "the prompt step did not land first"
            assert e.abort("b").finish_reason == FinishReason.ABORT
            reused["b"] = e.add_request("b", PROMPTS[7], GREEDY)
    tokens, reasons, _ = run(engine, requests, during=cancel_and_reuse)
    assert tokens["a"] == plain["a"] and reasons["a"] == FinishReason.LENGTH
    assert tokens["b"][1:] == alone, "the new request's tokens are not its own"
    assert "a request of the step finished, or a running one is not in it" in engine.overlap_blockers


@pytest.mark.parametrize("k", [0, 2])
def test_an_id_reused_right_after_a_cancel_under_a_step_in_flight_gets_only_its_own_tokens(model_dir, k):
    """Cancel "b" while a launched step still writes its row, then add a new request "b" at once:
    the dead row's token is not the new request's (it got max_tokens + 1 tokens, the first
    its predecessor's), and the new one starts only when its id's pool space is free."""
    requests = [("a", PROMPTS[0], GREEDY), ("b", PROMPTS[1], GREEDY)]
    alone = run(make(model_dir, False, k=k), [("b", PROMPTS[7], GREEDY)])[0]["b"]
    engine = make(model_dir, True, k=k)
    new = {}

    def cancel_and_reuse(e, i):
        if "b" not in new and e._in_flight is not None and "b" in e._in_flight.plan.request_ids and i > 4:
            assert e.abort("b").finish_reason == FinishReason.ABORT
            new["b"] = e.add_request("b", PROMPTS[7], GREEDY)
            new["tokens_before"] = list(tokens_so_far.get("b", []))
    tokens_so_far = {}
    original_step = engine.step

    def recording_step():
        events = original_step()
        for ev in events:
            tokens_so_far.setdefault(ev.request_id, []).extend(ev.token_ids)
        return events
    engine.step = recording_step
    tokens, reasons, _ = run(engine, requests, during=cancel_and_reuse)
    assert "b" in new
    reused = tokens_so_far["b"][len(new["tokens_before"]):]
    assert reused == alone and new["b"].num_output_tokens == GREEDY.max_tokens, (len(reused), len(alone))
    assert reasons["b"] == FinishReason.LENGTH


def test_cancelling_a_reused_id_before_it_starts_leaves_its_predecessors_row_to_the_step_in_flight(model_dir):
    """Cancel "b" under a step in flight, add a new "b", cancel that one too before any step: the
    new one held nothing, so nothing is released (its id's pool space was the old request's,
    still written by the step: releasing it moved a state row under that step)."""
    engine = make(model_dir, True)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None and "b" in engine._in_flight.plan.request_ids
    rows = engine.state_bank.num_free_rows
    engine.abort("b")
    engine.add_request("b", PROMPTS[2], GREEDY)
    assert engine.abort("b").finish_reason == FinishReason.ABORT
    assert engine.state_bank.num_free_rows == rows, "a row was released under the step that writes it"
    engine.check_integrity()
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    assert engine.is_idle_and_empty()


def test_a_session_turn_under_a_reused_id_still_caches_its_prompt_for_the_next_turn(model_dir):
    """A turn sent with ``continues`` snapshots its prompt's boundaries so the next turn starts
    from the cache, also when its id was a cancelled request's whose step was still in flight
    (the mark went to the old request's bookkeeping, dropped when that step landed)."""
    prompt = "".join(PROMPTS[:4])
    params = dataclasses.replace(GREEDY, max_tokens=8)

    def next_turn_cached(reuse: bool) -> int:
        engine = make(model_dir, True)
        engine.add_request("a", PROMPTS[5], GREEDY)
        if reuse:
            engine.add_request("b", PROMPTS[1], GREEDY)
            while engine._in_flight is None or "b" not in engine._in_flight.plan.request_ids:
                engine.step()
            engine.abort("b")
        first = engine.add_request("b", prompt, params, continues=True)
        while not first.finish_reason:
            engine.step()
        turn = engine.add_request("c", first.token_ids + engine.tokenizer.encode(" and more"), params)
        while not turn.finish_reason:
            engine.step()
        engine.check_integrity()
        return turn.num_cached_tokens
    plain = next_turn_cached(False)
    assert plain >= 32 and next_turn_cached(True) == plain


def test_arrivals_during_decoding_are_admitted_and_change_no_output(model_dir):
    first = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:4])]
    later = [(f"late{i}", p, GREEDY) for i, p in enumerate(PROMPTS[4:8])]
    results = []
    for overlap in (False, True):
        engine = make(model_dir, overlap)
        results.append(run(engine, first, during=arriving(later, (5, 11, 12, 30))))
    assert results[1] == results[0]
    assert set(results[1][0]) == {r for r, _, _ in first + later}
    assert engine.overlap_blockers.get("a waiting request can be admitted", 0) > 0


def closed_loop(engine: Engine, requests: list, concurrency: int, reply_steps: int = 0) -> tuple[dict, list[int], int]:
    """``requests`` run ``concurrency`` at a time, the next one added as one finishes (a client
    each; ``reply_steps``: that many engine steps after its finish, as a client answering
    through an event loop), pools checked after every step: ((tokens, finish reason) by id, each
    request's engine steps from its arrival to its first event, the steps that admitted a prompt)."""
    queue, tokens, reasons, arrived, waits, prompt_steps = list(requests), {}, {}, {}, [], 0
    in_flight, i, replying = set(), 0, []
    schedule = engine.scheduler.schedule

    def counting_schedule():
        nonlocal prompt_steps
        plan = schedule()
        prompt_steps += bool(plan.admitted)
        return plan
    engine.scheduler.schedule = counting_schedule
    while queue or engine.has_work or replying:
        replying = [due for due in replying if due > i]
        while queue and len(in_flight) + len(replying) < concurrency:
            rid, prompt, params = queue.pop(0)
            engine.add_request(rid, prompt, params)
            arrived[rid] = i
            in_flight.add(rid)
        for ev in engine.step():
            if ev.request_id not in tokens:
                waits.append(i + 1 - arrived[ev.request_id])
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finish_reason is not None:
                reasons[ev.request_id] = ev.finish_reason
                in_flight.discard(ev.request_id)
                if reply_steps:
                    replying.append(i + 1 + reply_steps)
        engine.check_integrity()
        i += 1
    assert engine.is_idle_and_empty()
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}, waits, prompt_steps


@pytest.mark.parametrize("k", [0, 2])
def test_held_arrivals_share_prompt_steps_within_the_hold_and_change_no_output(model_dir, k):
    """Admission holds (CUDA's default, MTP engines): clients sending a request as theirs ends,
    over requests of staggered lengths; held arrivals go in together, in fewer prompt steps,
    each within the hold, and every token is the one admitting at once gives (and MTP off's).
    With MTP off nothing is held (K=0 lost 5% to holds at C=8 on the H100, gaining nothing)."""
    requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0, max_tokens=8 + 5 * i % 13,
                                                                    ignore_eos=True)) for i in range(24)]
    # 9 clients: beside 8 decoding, arrivals are held until 2 wait (the default group, 0.25 a request)
    at_once = closed_loop(make(model_dir, True, k=k, uniform=bool(k)), requests, 9)
    held = closed_loop(make(model_dir, True, k=k, uniform=bool(k), hold=6), requests, 9)
    assert held[0] == at_once[0]
    if k:
        assert held[0] == closed_loop(make(model_dir, True), requests, 9)[0], "MTP on != MTP off"
    print(f"K={k}: prompt steps {at_once[2]} at once, {held[2]} held; steps to the first token "
          f"{sorted(at_once[1])} / {sorted(held[1])}")
    if not k:
        assert held[1:] == at_once[1:], "MTP off held arrivals"
        return
    assert held[2] < at_once[2], "held arrivals did not share prompt steps"
    assert max(held[1]) <= 6 + max(at_once[1]), "a request waited past its hold"


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_steps_through_varlen_bindings_under_steps_in_flight_keep_every_token(model_dir, k):
    """``prompt_graphs`` with overlapped steps, CUDA's draft rules and holds: 9 clients over 24
    requests of staggered lengths (arrivals beside decoding and draft steps in flight, a prompt
    step landing before its continuation); every prompt step takes a varlen binding (run eagerly
    on the CPU, as a captured one replays on CUDA) and every token is MTP off's, admitting at once."""
    requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0, max_tokens=8 + 5 * i % 13,
                                                                    ignore_eos=True)) for i in range(24)]
    reference = closed_loop(make(model_dir, True), requests, 9)[0]
    engine = make(model_dir, True, k=k, uniform=bool(k), hold=6 if k else 0, prompt_graphs=True)
    tokens = closed_loop(engine, requests, 9)[0]
    g = engine.prompt_graphs
    print(f"K={k}: {g.num_replays} prompt steps bound, {g.num_eager} eager; {engine.num_continuations} of "
          f"{engine.num_steps} steps launched in flight")
    assert tokens == reference
    assert g.num_replays > 0 and g.num_eager == 0
    assert engine.num_continuations > 0


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_steps_through_varlen_bindings_under_preemption_keep_every_token(model_dir, k):
    """``prompt_graphs`` when the KV pool runs out: 10 requests on 24 usable blocks, so the
    scheduler preempts and the preempted requests' prompts are fed again on other state rows
    (the pools checked after every step). Every token is MTP off's without prompt graphs; the
    recomputed prompts go through the bindings too, or eagerly where their rows are not placed."""
    crowded = [(f"g{i}", PROMPTS[i], GREEDY) for i in range(10)]
    reference = run(make(model_dir, False, num_blocks=25), crowded)
    engine = make(model_dir, True, k=k, uniform=bool(k), num_blocks=25, prompt_graphs=True)
    assert run(engine, crowded) == reference
    g = engine.prompt_graphs
    print(f"K={k}: {engine.num_preemptions} preemptions, {g.num_replays} prompt steps bound, {g.num_eager} eager")
    assert engine.num_preemptions > 0 and g.num_replays > 1


@pytest.mark.parametrize("prompt_graphs", [False, True])
def test_the_heads_early_catch_up_under_preemption_keeps_every_token(model_dir, prompt_graphs):
    """``early_head_catch_up`` when the pools run out: 10 requests on 24 usable blocks, CUDA's
    draft rules, so the head's KV for a completed prompt is sometimes not there to reserve (the
    request then catches up later, as without it) and preempted requests' prompts are fed and
    caught up again on fresh blocks; the pools are checked after every step. Every token is MTP
    off's, and prompts did catch up early."""
    crowded = [(f"g{i}", PROMPTS[i], GREEDY) for i in range(10)]
    reference = run(make(model_dir, False, num_blocks=25), crowded)
    engine = make(model_dir, True, k=2, uniform=True, num_blocks=25, prompt_graphs=prompt_graphs)
    engine.draft_after_decode = engine.early_head_catch_up = True
    caught = []
    catch_up = engine.proposer.catch_up
    engine.proposer.catch_up = lambda requests: caught.extend(requests) or catch_up(requests)
    assert run(engine, crowded) == reference
    print(f"prompt graphs {prompt_graphs}: {engine.num_preemptions} preemptions, {len(caught)} early catch-ups")
    assert engine.num_preemptions > 0 and caught


def test_the_reasons_a_step_had_no_continuation_are_counted_by_reason_not_by_request(model_dir):
    """``overlap_blockers`` (the bench's report) holds one count per reason: requests ending at
    different lengths, with ids that hold spaces, add to the same few keys."""
    for k in (0, 2):
        engine = make(model_dir, True, k=k, synthetic=0.7 if k else None, uniform=bool(k))
        run(engine, [(f"client {i} turn {i}", p, SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True))
                     for i, p in enumerate(PROMPTS[:6])])
        if not k:
            assert any("ends" in why for why in engine.overlap_blockers), engine.overlap_blockers
        assert not any("client" in why for why in engine.overlap_blockers), engine.overlap_blockers
        assert len(engine.overlap_blockers) <= 6, engine.overlap_blockers


def test_preemption_and_requests_it_must_not_overlap_keep_every_output(model_dir):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True)
    requests = [
        *((f"g{i}", PROMPTS[i], GREEDY) for i in range(8)),
        ("seeded", PROMPTS[9], seeded),
        ("penalties", PROMPTS[10], dataclasses.replace(GREEDY, repetition_penalty=1.3, presence_penalty=0.5)),
        ("logprobs", PROMPTS[11], dataclasses.replace(GREEDY, logprobs=2)),
        ("min-tokens", PROMPTS[3], SamplingParams(temperature=0, max_tokens=40, min_tokens=20)),
    ]
    # 24 usable blocks cannot hold 12 requests of ~60 tokens: the scheduler preempts
    plain, overlapped, engine = both(model_dir, requests, num_blocks=25)
    assert overlapped == plain
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("k", [0, 2])
def test_sampled_requests_overlap_and_draw_what_stepping_one_at_a_time_draws(model_dir, k):
    """Seeded requests draw with their (seed, position) noise, any other at its RNG's next
    uniform: the same draws, in the same order, as stepping one step at a time (each unseeded
    request's RNG is seeded here, alike in both engines, so its draws can be compared). With
    MTP (one K for all, as under CUDA graphs) a step whose drafts a sampled request verifies is
    not launched in flight: its accept is rejection sampling on the host, not the device's
    greedy one."""
    kinds = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=1.0, top_k=20, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=0.7, min_p=0.05, top_p=0.95, max_tokens=40),
             GREEDY]
    requests = [(f"r{i}", p, kinds[i % 4]) for i, p in enumerate(PROMPTS[:12])]
    results = []
    for overlap in (False, True):
        engine = make(model_dir, overlap, k=k, uniform=bool(k))
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params).rng = np.random.default_rng(int(rid[1:]))
        results.append(run(engine, []))
    assert results[1] == results[0]
    if k:
        assert engine.stats.num_drafts > 0
    else:
        assert engine.num_continuations > 0.5 * engine.num_steps, engine.overlap_blockers


def test_draft_steps_in_flight_stay_within_the_steps_token_budget(model_dir):
    """``max_tokens_per_step`` holds for a draft step launched behind another as for a planned
    one: after a decode step of six requests (6 rows), a draft step of them with 2 drafts each
    would feed 18, over a budget of 12, so it is not launched behind it (the scheduler then runs
    the requests that fit)."""
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:6])]
    plain = run(make(model_dir, False, budget=12, k=2, uniform=True), requests)
    engine = make(model_dir, True, budget=12, k=2, uniform=True)
    engine.draft_after_decode = True
    rows = []
    assert run(engine, requests, during=lambda e, i: rows.append(e.last_step.num_main_tokens if e.last_step else 0)) \
        == plain
    assert max(rows) <= 12, rows
    assert "the draft step exceeds the step's token budget" in engine.overlap_blockers, engine.overlap_blockers


@pytest.mark.parametrize("k", [0, 2])
def test_requests_whose_logits_the_host_processes_keep_their_tokens_beside_overlapped_ones(model_dir, k):
    """Penalties and a min_tokens mask apply to a request's logits on the host, so its steps
    are not followed in flight (a continuation's token is picked from the raw logits on the
    device, a draft step's accept is the raw argmax): with them in the batch, every request's
    tokens are stepping's. Few requests, all running from the start, so steps would follow."""
    requests = [("penalties", PROMPTS[10], dataclasses.replace(GREEDY, repetition_penalty=1.3, presence_penalty=0.5)),
                ("min-tokens", PROMPTS[3], SamplingParams(temperature=0, max_tokens=40, min_tokens=30)),
                ("frequency", PROMPTS[4], dataclasses.replace(GREEDY, frequency_penalty=0.8))]
    plain = run(make(model_dir, False, k=k, uniform=bool(k)), requests)
    engine = make(model_dir, True, k=k, uniform=bool(k))
    assert run(engine, requests) == plain


@pytest.mark.parametrize("k", [0, 2])
def test_a_prompt_step_lands_before_its_continuation_which_keeps_the_min_tokens_mask(model_dir, k):
    """A step that fed a prompt lands and its first token goes out before its continuation is
    launched, at the start of the next step call (``land_prompts_first``, on with MTP): its
    landing finds nothing in flight, the next one does. The continuation's output position is
    then the one after the token already appended: with min_tokens 2 and the token plain
    decoding would emit second as a stop id, that position is still masked (its step is not
    launched in flight), and the tokens are stepping's."""
    assert make(model_dir, True, k=2).land_prompts_first and not make(model_dir, True).land_prompts_first
    probe = [("probe", PROMPTS[5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))]
    plain = run(make(model_dir, False), probe)[0]["probe"]
    engine = make(model_dir, True)
    engine.land_prompts_first = True
    in_flight = []                     # at each landing, whether a step was in flight
    land = engine._land
    engine._land = lambda flight: in_flight.append(engine._in_flight is not None) or land(flight)
    assert run(engine, probe)[0]["probe"] == plain
    assert in_flight[0] is False and in_flight[1] is True, f"the prompt step landed behind its continuation: {in_flight}"
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=2, stop_token_ids=[plain[1]])
    requests = [("masked", PROMPTS[5], params)]
    expected = run(make(model_dir, False, k=k, uniform=bool(k)), requests)
    engine = make(model_dir, True, k=k, uniform=bool(k))
    engine.land_prompts_first = True
    assert run(engine, requests) == expected
    assert len(expected[0]["masked"]) >= 2 and plain[1] not in expected[0]["masked"][:2]


def closed_loop_requests() -> list[tuple[str, object, SamplingParams]]:
    """24 greedy requests over 8 prompts (prefix hits), max_tokens 8-20: for ``closed_loop`` with
    9 clients, a hold's group fills as requests end."""
    return [(f"r{i}", PROMPTS[i % 8], SamplingParams(temperature=0, max_tokens=8 + 5 * i % 13, ignore_eos=True))
            for i in range(24)]


def test_the_heads_catch_up_queued_behind_a_prompt_step_keeps_every_token_and_draft(model_dir):
    """``early_head_catch_up``: the head catches up on the prompts a launched prompt step
    completed behind that step, not in the draft step after it. CUDA's rules (uniform drafts,
    holds, a draft step after a decode step), 9 clients over 24 requests of 8 prompts (prefix
    hits, recurrent-state snapshots at chunk boundaries, chunked prompts: a 48-token budget),
    pools checked after every step: the tokens are MTP off's, and the drafts the same engine
    makes without it, to the count (the head's KV holds the same rows, written earlier), while
    prompts did catch up early and the prefix cache took snapshots."""
    requests = closed_loop_requests()
    reference = closed_loop(make(model_dir, True), requests, 9)[0]
    runs = {}
    for early in (False, True):
        engine = make(model_dir, True, k=2, uniform=True, hold=6)
        engine.draft_after_decode = True
        engine.early_head_catch_up = early
        caught = []
        catch_up = engine.proposer.catch_up
        engine.proposer.catch_up = lambda requests, f=catch_up, c=caught: c.extend(requests) or f(requests)
        tokens = closed_loop(engine, requests, 9)[0]
        stats = engine.stats
        runs[early] = (tokens, stats.num_draft_tokens, stats.num_accepted_tokens)
        print(f"early={early}: {len(caught)} prompts caught up at their launch; drafts {stats.num_draft_tokens}, "
              f"accepted {stats.num_accepted_tokens}; snapshots {engine.prefix_cache.stats.num_snapshots_taken}")
        assert tokens == reference
        assert bool(caught) == early
        assert engine.prefix_cache.stats.num_snapshots_taken > 0
    assert runs[True] == runs[False]


def cuda_rules(model_dir, prompt_continuations: bool, k=2, **kw) -> Engine:
    """An MTP engine (K=2, or ``k``: "auto") stepping as on CUDA: overlapped, uniform drafts, a
    draft step after a decode step, the head's early catch-up; ``prompt_continuations`` as given."""
    engine = make(model_dir, True, k=k, uniform=True, **kw)
    engine.draft_after_decode = engine.early_head_catch_up = True
    engine.prompt_continuations = prompt_continuations
    return engine


@pytest.mark.parametrize("prompt_graphs", [False, True])
def test_prompt_steps_launched_as_a_draft_steps_continuation_keep_every_token_and_draft(model_dir, prompt_graphs):
    """``prompt_continuations``: where a draft step stops for the arrivals due (held 4 steps),
    their prompt step is launched behind it instead, its requests fed one row each at positions
    moved by its acceptance (through the varlen bindings with ``prompt_graphs``, as on CUDA;
    else from the host's copy of it). Arrivals at fixed steps, so both engines admit the same
    requests into the same steps: the tokens are MTP off's, and the drafts and accepted counts
    are those of the same engine stopping (the head's hidden rows kept in position order), while
    every arrival's prompt step followed a draft step in flight (and took a binding)."""
    first = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
             for i, p in enumerate(PROMPTS[:4])]
    later = [(f"late{i}", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
             for i, p in enumerate(PROMPTS[4:8])]
    steps = (4, 10, 16, 22)
    reference = run(make(model_dir, False), first, during=arriving(later, steps))
    runs = {}
    for on in (False, True):
        engine = cuda_rules(model_dir, on, hold=4, prompt_graphs=prompt_graphs)
        tokens = run(engine, first, during=arriving(later, steps))
        stats = engine.stats
        runs[on] = (tokens, stats.num_draft_tokens, stats.num_accepted_tokens)
        g = engine.prompt_graphs
        print(f"prompt continuations {on}: {engine.num_prompt_continuations} launched, "
              f"{engine.num_prompts_followed} followed in flight; drafts "
              f"{stats.num_draft_tokens}, accepted {stats.num_accepted_tokens}; "
              + (f"prompt steps bound {g.num_replays}, eager {g.num_eager}; " if g is not None else "")
              + f"stops {engine.overlap_blockers}")
        assert tokens == reference
        assert engine.num_prompt_continuations == (len(later) if on else 0)
        assert bool(engine.num_prompts_followed) == on
        if g is not None:
            assert g.num_eager == 0
    assert runs[True] == runs[False]


@pytest.mark.parametrize("prompt_graphs", [False, True])
def test_prompt_continuations_taking_the_rows_of_requests_that_ended_keep_every_token(model_dir, prompt_graphs):
    """``prompt_continuations`` in a closed loop (9 clients over 24 requests of 8 prompts:
    prefix hits, chunked prompts; 9 state rows), where a hold's group fills as requests end:
    the draft step in flight still has their rows, so the prompt continuation releases them
    first (queued behind that step) and an arrival takes a freed row; the moved requests' order
    and acceptance rows follow the bank's move. Every token is MTP off's, pools checked after
    every step; such prompt steps were launched (through the bindings, with ``prompt_graphs``)."""
    requests = closed_loop_requests()
    reference = closed_loop(make(model_dir, True), requests, 9)[0]
    engine = cuda_rules(model_dir, True, hold=6, max_rows=9, prompt_graphs=prompt_graphs)
    ended = []
    launch = engine._launch_prompt_continuation

    def counting(flight, live):
        step = launch(flight, live)
        if step is not None:
            ended.append(live.count(False))
        return step
    engine._launch_prompt_continuation = counting
    assert closed_loop(engine, requests, 9)[0] == reference
    g = engine.prompt_graphs
    print(f"prompt graphs {prompt_graphs}: {len(ended)} prompt continuations ({engine.num_prompts_followed} "
          f"followed in flight), rows of ended requests released first {ended}"
          + (f"; prompt steps bound {g.num_replays}, eager {g.num_eager}" if g is not None else ""))
    assert any(ended)
    if g is not None:
        assert g.num_eager == 0


@pytest.mark.parametrize("prompt_graphs", [False, True])
def test_prompt_continuations_under_preemption_keep_every_token(model_dir, prompt_graphs):
    """``prompt_continuations`` when the KV pool runs out (10 requests, 4 of them arriving
    while the others decode, on 16 usable blocks): a prompt continuation whose rows' KV does not
    fit is not launched (the pipeline stops for the arrivals, as without), preempted requests
    come back through the queue. Every token is MTP off's on the same pool, the pools are
    checked after every step and return to empty; prompt steps were launched behind draft steps
    and refused for KV."""
    first = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
             for i, p in enumerate(PROMPTS[:6])]
    later = [(f"late{i}", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
             for i, p in enumerate(PROMPTS[6:10])]
    steps = (3, 9, 15, 21)
    reference = run(make(model_dir, False, num_blocks=17), first, during=arriving(later, steps))
    engine = cuda_rules(model_dir, True, num_blocks=17, hold=4, prompt_graphs=prompt_graphs)
    assert run(engine, first, during=arriving(later, steps)) == reference
    stops = engine.overlap_blockers.get("a waiting request can be admitted", 0)
    print(f"prompt graphs {prompt_graphs}: {engine.num_preemptions} preemptions, "
          f"{engine.num_prompt_continuations} prompt continuations, {stops} stops for arrivals")
    assert engine.num_preemptions > 0 and engine.num_prompt_continuations > 0 and stops > 0


def test_no_draft_step_is_launched_on_requests_that_may_all_have_ended(model_dir):
    """A draft step in flight whose tokens may end every one of its requests (max_tokens within
    its 1 + K) gets no continuation: such a continuation could run on dead rows alone, a step of
    GPU time that the next request's prompt queues behind. One request at a time, K=3: no
    step lands with every row dead, and the tokens are stepping's."""
    requests = [("r0", PROMPTS[0], SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))]
    plain = run(make(model_dir, False, k=3, uniform=True), requests)
    engine = make(model_dir, True, k=3, uniform=True)
    dead = []
    land = engine._land
    engine._land = lambda flight: dead.append(all(s.request.finish_reason is not None
                                                  for s in flight.plan.scheduled)) or land(flight)
    assert run(engine, requests) == plain
    assert engine.num_draft_continuations > 0
    assert not any(dead), f"{sum(dead)} steps landed on dead rows alone"
    assert engine.overlap_blockers.get("every request may end with the step's tokens"), engine.overlap_blockers


def test_the_cpu_default_is_off(model_dir):
    assert not make(model_dir, None).overlap


def _spec_counts(engine: Engine) -> tuple:
    st = engine.stats
    return st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.num_emitted_tokens


@pytest.mark.parametrize("k,uniform", [(2, False), (3, True)])
def test_draft_steps_overlap_and_keep_the_tokens_and_acceptance_of_stepping_one_at_a_time(model_dir, k, uniform):
    """A draft step is launched before the one it follows has landed: its drafts come from that
    step's acceptance on the device, and its tokens, acceptance and pools are stepping's (and
    MTP off's), through batching, chunked prefill, stop ids, stop strings and max_tokens (with
    uniform drafts, as under CUDA graphs, a request ending in a step is a dead row of the next)."""
    probe = make(model_dir, False)
    text = run(probe, [("p", PROMPTS[2], GREEDY)])[2]["p"]
    ids = probe.tokenizer.encode(text)
    requests = [*((f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:6])),
                ("stop-string", PROMPTS[2], dataclasses.replace(GREEDY, stop=[text[20:24]])),
                ("stop-id", PROMPTS[2], dataclasses.replace(GREEDY, stop_token_ids=[ids[11]])),
                ("eos", PROMPTS[3], SamplingParams(temperature=0, max_tokens=40)),
                ("len13", PROMPTS[7], dataclasses.replace(GREEDY, max_tokens=13))]
    mtp_off = run(make(model_dir, False), requests)
    shapes = {False: [], True: []}         # what each draft step ran, as the draft policy's cost fit sees it

    def shape(e, i):
        t = e.last_step
        if t is not None and t.num_head_forwards:
            shapes[e.overlap].append((t.num_requests, t.num_main_tokens, t.num_head_forwards, t.num_head_rows))
    stepping = make(model_dir, False, k=k, uniform=uniform)
    plain = run(stepping, requests)
    engine = make(model_dir, True, k=k, uniform=uniform)
    overlapped = run(engine, requests, during=shape)
    num_draft_steps = len(shapes[True])
    assert overlapped == plain == mtp_off
    assert _spec_counts(engine) == _spec_counts(stepping)
    if not uniform:    # no stop: no dead row, the same steps (the head rows each caught up on included)
        shapes[True].clear()
        for overlap in (False, True):
            run(make(model_dir, overlap, k=k), requests[:6], during=shape)
        assert shapes[True] == shapes[False] and len(shapes[True]) > 10
    print(f"K={k} uniform={uniform}: {engine.num_draft_continuations} draft continuations of {num_draft_steps} draft "
          f"steps; {engine.overlap_blockers}")
    assert engine.num_draft_continuations > 0.5 * num_draft_steps


def test_synthetic_acceptance_draws_in_stepping_order_with_draft_steps_in_flight(model_dir):
    """Benchmarks' synthetic acceptance accepts drafts without checking them (the tokens then
    differ from MTP off's): the overlapped engine accepts the same drafts as stepping."""
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:6])]
    plain = run(make(model_dir, False, k=3, synthetic=0.6), requests)
    engine = make(model_dir, True, k=3, synthetic=0.6)
    assert run(engine, requests) == plain
    assert engine.num_draft_continuations > 0


def test_a_cancel_under_a_draft_step_in_flight_releases_its_row_when_that_step_lands(model_dir):
    requests = [("a", PROMPTS[0], GREEDY), ("b", PROMPTS[1], GREEDY), ("c", PROMPTS[5], GREEDY)]
    plain = run(make(model_dir, False), requests)
    engine = make(model_dir, True, k=2)
    seen = {}

    def cancel(e, i):
        if "rows" not in seen and e._in_flight is not None and e._in_flight.num_drafts and i > 4:
            rows = e.state_bank.num_free_rows
            assert e.abort("b").finish_reason == FinishReason.ABORT
            assert e.state_bank.num_free_rows == rows          # its row is still written by the launched step
            seen["rows"], seen["at"] = rows, i
        elif "at" in seen and i == seen["at"] + 1:
            assert e.state_bank.num_free_rows == seen["rows"] + 1
    tokens, reasons, _ = run(engine, requests, during=cancel)
    assert "at" in seen and "b" not in reasons and len(tokens["b"]) < len(plain[0]["b"])
    assert tokens["b"] == plain[0]["b"][:len(tokens["b"])]
    assert {r: tokens[r] for r in "ac"} == {r: plain[0][r] for r in "ac"}


def test_draft_steps_in_flight_near_the_context_end_and_under_preemption_keep_every_output(model_dir):
    ends = [(f"r{i}", p, dataclasses.replace(GREEDY, max_tokens=200)) for i, p in enumerate(PROMPTS[:6])]
    plain = run(make(model_dir, False, max_model_len=64), ends)
    engine = make(model_dir, True, k=3, max_model_len=64)
    assert run(engine, ends) == plain
    assert engine.num_draft_continuations > 0
    crowded = [(f"g{i}", PROMPTS[i], GREEDY) for i in range(10)]
    plain = run(make(model_dir, False, num_blocks=25), crowded)
    engine = make(model_dir, True, k=2, num_blocks=25)
    assert run(engine, crowded) == plain
    assert engine.num_preemptions > 0 and engine.num_draft_continuations > 0


class EveryThirdStepDrafts(DraftPolicy):
    """A draft policy whose answers go 0, 0, 3, 0, 0, 3, ... however often it is asked."""

    def __init__(self):
        self.answers, self.draft_steps = [], 0

    def num_drafts(self, request) -> int:
        return 0

    def observe_step(self, timing) -> None:
        self.draft_steps += timing is not None and timing.num_head_forwards > 0

    def step_drafts(self, requests, uniform):
        k = 3 if len(self.answers) % 3 == 2 else 0
        self.answers.append(k)
        return [k] * len(requests)


def test_mtp_engines_overlap_their_steps_without_drafts_and_keep_every_planned_draft_step(model_dir):
    """The policy is asked once per step: its answer to a continuation check is the next
    schedule's, so none of its draft steps is lost (asked again, it would say 0 each time)."""
    requests = [(f"r{i}", p, dataclasses.replace(GREEDY, max_tokens=120)) for i, p in enumerate(PROMPTS[:6])]
    plain = run(make(model_dir, False), requests)
    policy = EveryThirdStepDrafts()
    engine = Engine(dataclasses.replace(make(model_dir, True, k=3).config), policy)
    overlapped = run(engine, requests)
    assert overlapped == plain                             # MTP on, overlapped: the K=0 engine's tokens
    drafted = sum(1 for k in policy.answers if k)
    print(f"{engine.num_continuations} continuations of {engine.num_steps} steps; the policy asked "
          f"{len(policy.answers)} times, {drafted} draft steps planned, {policy.draft_steps} run")
    assert engine.num_continuations > 0.3 * engine.num_steps
    assert policy.draft_steps >= drafted - 1 > 15          # the last plan may find the requests finished


class DraftsInRuns(EveryThirdStepDrafts):
    """Answers 0 four times, then 3 four times, ...; keeps each step's timing."""

    def __init__(self):
        super().__init__()
        self.timings = []

    def observe_step(self, timing) -> None:
        if timing is not None:
            self.timings.append(timing)

    def step_drafts(self, requests, uniform):
        k = 3 if len(self.answers) // 4 % 2 else 0
        self.answers.append(k)
        return [k] * len(requests)


@pytest.mark.parametrize("overlap", [True, False])
def test_step_timings_say_which_steps_ran_behind_the_one_before(model_dir, overlap):
    """``StepTiming.pipelined`` (what a draft policy may leave out of its step-cost fit): a step
    launched by the step before it is pipelined; one that changes kind, drafting or not, runs
    alone (the engine continues a step only with one of its kind); without overlap, unknown."""
    requests = [(f"r{i}", p, dataclasses.replace(GREEDY, max_tokens=60)) for i, p in enumerate(PROMPTS[:4])]
    policy = DraftsInRuns()
    engine = Engine(dataclasses.replace(make(model_dir, overlap, k=3).config), policy)
    run(engine, requests)
    flags = [t.pipelined for t in policy.timings]
    if not overlap:
        assert set(flags) == {None}
        return
    assert None not in flags
    kinds = [t.num_head_forwards > 0 for t in policy.timings]
    changed = [i for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1]]
    assert changed and not any(flags[i] for i in changed), "a step that changed kind ran behind the one before"
    steady = [flags[i] for i in range(1, len(kinds)) if kinds[i] == kinds[i - 1] and not policy.timings[i].has_prefill]
    assert sum(steady) > 0.7 * len(steady), f"steps of a steady kind mostly run behind the one before: {flags}"


def test_auto_drafting_overlaps_its_steps_without_drafts_and_keeps_greedy_tokens(model_dir):
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:8])]
    plain, overlapped, engine = both(model_dir, requests, k="auto")
    assert overlapped == plain
    assert engine.num_continuations > 0 and engine.stats.num_drafts > 0


@pytest.mark.parametrize("max_rows", [2, 3])
def test_a_full_state_bank_keeps_overlapping_while_requests_wait_for_a_row(model_dir, max_rows):
    requests = [(f"r{i}", p, dataclasses.replace(GREEDY, max_tokens=12 + 5 * i)) for i, p in enumerate(PROMPTS[:6])]
    plain, overlapped, engine = both(model_dir, requests, max_rows=max_rows)
    assert overlapped == plain
    assert engine.num_continuations > 0


@pytest.mark.parametrize("k,uniform", [(2, True), (3, False)])
def test_a_draft_step_after_a_decode_step_in_flight_keeps_stepping_tokens(model_dir, k, uniform):
    """``draft_after_decode``: the first draft step after a decode step (a prompt's last chunk, a
    newcomer's first token, auto's switch to drafting) is launched behind it, its drafts from the
    head caught up on the decode step's rows (all but the last from the host's ids, the last with
    the step's token on the device). Tokens and pools are stepping's, through arrivals, prompt
    chunks, stop strings, stop ids and max_tokens (MTP off's: the next test). (Arrivals come at
    step indices, which the two engines reach with other batches: their draft counts differ.)"""
    probe = make(model_dir, False)
    text = run(probe, [("p", PROMPTS[2], GREEDY)])[2]["p"]
    ids = probe.tokenizer.encode(text)
    first = [*((f"r{i}", p, dataclasses.replace(GREEDY, max_tokens=20 + 7 * i)) for i, p in enumerate(PROMPTS[:5])),
             ("stop-string", PROMPTS[2], dataclasses.replace(GREEDY, stop=[text[20:24]])),
             ("stop-id", PROMPTS[2], dataclasses.replace(GREEDY, stop_token_ids=[ids[11]]))]
    later = [(f"late{i}", p, dataclasses.replace(GREEDY, max_tokens=25)) for i, p in enumerate(PROMPTS[5:9])]

    arrive = arriving(later, (4, 9, 10, 23))
    plain = run(make(model_dir, False, k=k, uniform=uniform), first, during=arrive)
    engine = make(model_dir, True, k=k, uniform=uniform)
    engine.draft_after_decode = True
    assert run(engine, first, during=arrive) == plain
    print(f"K={k} uniform={uniform}: {engine.num_drafts_after_decode} draft steps after a decode step, "
          f"{engine.num_draft_continuations} after a draft step; {engine.overlap_blockers}")
    assert engine.num_drafts_after_decode > 0
    assert "the draft policy drafts next" not in engine.overlap_blockers


def test_no_draft_step_follows_a_decode_step_in_flight_when_a_request_samples(model_dir):
    """``draft_after_decode`` is for greedy steps: the device's accept is the argmax, so a
    sampled request's drafts wait for the host's rejection sampling. Through arrivals (each
    newcomer's prompt step is a decode step of the others), sampled requests draw what
    stepping one step at a time draws (their RNGs seeded alike), greedy ones keep their tokens."""
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True),
               SamplingParams(temperature=1.0, top_k=20, max_tokens=30, ignore_eos=True)]
    first = [(f"r{i}", p, sampled[i % 2] if i < 2 else GREEDY) for i, p in enumerate(PROMPTS[:5])]
    later = [(f"late{i}", p, dataclasses.replace(GREEDY, max_tokens=25)) for i, p in enumerate(PROMPTS[5:9])]
    results = []
    for overlap in (False, True):
        engine = make(model_dir, overlap, k=2, uniform=True)
        engine.draft_after_decode = True
        for rid, prompt, params in first:
            engine.add_request(rid, prompt, params).rng = np.random.default_rng(int(rid[1:]))
        results.append(run(engine, [], during=arriving(later, (3, 6, 9, 12))))
        assert "late3" in results[-1][0]
    assert results[1] == results[0]
    assert "the draft policy drafts next, and a request samples" in engine.overlap_blockers, engine.overlap_blockers


def test_a_draft_step_after_a_decode_step_follows_auto_and_a_policy_switching_depths(model_dir):
    """With a policy that drafts every third step and auto, each switch to drafting follows the
    decode step before it, and the tokens stay MTP off's."""
    requests = [(f"r{i}", p, dataclasses.replace(GREEDY, max_tokens=60)) for i, p in enumerate(PROMPTS[:6])]
    plain = run(make(model_dir, False), requests)
    policy = EveryThirdStepDrafts()
    engine = Engine(dataclasses.replace(make(model_dir, True, k=3).config), policy)
    engine.scheduler.uniform_drafts = True
    engine.draft_after_decode = True
    assert run(engine, requests) == plain
    assert engine.num_drafts_after_decode > 5, engine.overlap_blockers
    auto = make(model_dir, True, k="auto", uniform=True)
    auto.draft_after_decode = True
    assert run(auto, requests) == plain


def test_the_lookahead_gathers_a_waves_arrivals_into_fewer_prompt_steps(model_dir):
    """Every request the same length (waves), K=2, clients sending a request as theirs ends: with
    the admission lookahead a gathered group waits for the requests about to end, so the
    arrivals of a wave share fewer prompt steps than with the group alone, every wait within
    the hold, and the tokens are the ones admitting at once gives."""
    requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                for i in range(32)]

    def engine(**kw):                # (dead rows not carried: they gather arrivals too; the next test)
        e = make(model_dir, True, k=2, uniform=True, **kw)
        e.carry_dead_rows = False
        return e
    at_once = closed_loop(engine(), requests, 8)
    group = closed_loop(engine(hold=6), requests, 8)
    ahead = closed_loop(engine(hold=6, lookahead=2), requests, 8)
    print(f"prompt steps: {at_once[2]} at once, {group[2]} held, {ahead[2]} with the lookahead; steps to the "
          f"first token {sorted(group[1])} / {sorted(ahead[1])}")
    assert ahead[0] == group[0] == at_once[0]
    assert ahead[2] < group[2], "the lookahead did not gather arrivals"
    assert max(ahead[1]) <= 6 + max(at_once[1]), "a request waited past its hold"


def test_held_arrivals_keep_the_draft_steps_pipeline_through_finishes(model_dir):
    """While arrivals are held, a draft step whose request ended carries its dead row into the
    next draft step instead of stopping the pipeline (a finish then costs no step launched
    alone): waves of equal lengths and varied ones, K=2 and 3, greedy tokens as admitting at
    once gives, pools checked after every step, fewer steps stopped by a finish, no request
    waiting past its hold, and the dead rows released at the end."""
    for k, lengths in ((2, [24]), (3, [9, 17, 30, 24, 13])):
        requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)],
                     SamplingParams(temperature=0, max_tokens=lengths[i % len(lengths)], ignore_eos=True))
                    for i in range(24)]
        at_once = closed_loop(make(model_dir, True, k=k, uniform=True), requests, 6)
        runs = {}
        for carry in (False, True):
            e = make(model_dir, True, k=k, uniform=True, hold=6)
            e.carry_dead_rows = carry
            runs[carry] = closed_loop(e, requests, 6), e
        (tokens, waits, _), carried = runs[True]
        (_, waits_off, _), stopped = runs[False]
        finished = "a request of the step finished, or a running one is not in it"
        print(f"K={k}: {carried.num_dead_carried} draft steps carried a dead row; stopped by a finish "
              f"{carried.overlap_blockers.get(finished, 0)} vs {stopped.overlap_blockers.get(finished, 0)} times; "
              f"steps to the first token {max(waits)} vs {max(waits_off)}")
        assert tokens == at_once[0]
        assert carried.num_dead_carried > 0 and stopped.num_dead_carried == 0
        assert carried.overlap_blockers.get(finished, 0) < stopped.overlap_blockers.get(finished, 0)
        assert max(waits) <= 6 + max(at_once[1]), "a request waited past its hold"


def test_holds_gather_arrivals_with_as_many_slots_and_rows_as_clients(model_dir):
    """The bench's pools (a step's slots and the state rows equal to the clients, C=6), K=2,
    clients sending a request as theirs ends: held arrivals share fewer prompt steps than
    admitting at once, each within the hold, with the same greedy tokens (before session 31
    the group was capped by the slots free, which here are the requests that ended: nothing
    was held, and the bench on the H100 ran ~1.5 prompts a prompt step)."""
    requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)],
                 SamplingParams(temperature=0, max_tokens=[24, 13, 30][i % 3], ignore_eos=True)) for i in range(30)]
    at_once = closed_loop(make(model_dir, True, k=2, uniform=True, max_rows=6, batch=6), requests, 6)
    held = closed_loop(make(model_dir, True, k=2, uniform=True, hold=6, max_rows=6, batch=6), requests, 6)
    print(f"prompt steps: {at_once[2]} at once, {held[2]} held")
    assert held[0] == at_once[0]
    assert held[2] < at_once[2], "no arrivals gathered"
    assert max(held[1]) <= 6 + max(at_once[1]), "a request waited past its hold"


def test_a_finish_with_nothing_waiting_keeps_the_draft_steps_pipeline(model_dir):
    """Clients that answer a finish a step or two later (over HTTP, through an event loop): at
    the finish nothing waits, and a draft step's continuation carries the dead row rather than
    stopping: dead rows carried, fewer steps stopped by a finish, greedy tokens as admitting
    at once gives, pools checked after every step and the dead rows released at the end."""
    finished = "a request of the step finished, or a running one is not in it"
    stops = {False: 0, True: 0}
    for k, lengths in ((2, [24]), (3, [9, 17, 30, 24, 13])):
        requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)],
                     SamplingParams(temperature=0, max_tokens=lengths[i % len(lengths)], ignore_eos=True))
                    for i in range(24)]
        for reply in (1, 2):
            at_once = closed_loop(make(model_dir, True, k=k, uniform=True), requests, 6, reply_steps=reply)
            for carry in (False, True):
                e = make(model_dir, True, k=k, uniform=True, hold=6)
                e.carry_dead_rows = carry
                tokens, _, _ = closed_loop(e, requests, 6, reply_steps=reply)
                assert tokens == at_once[0]
                stops[carry] += e.overlap_blockers.get(finished, 0)
                if carry:
                    assert e.num_dead_carried > 0, f"K={k}, reply {reply}: no dead row carried"
    print(f"steps stopped by a finish: {stops[False]} without carrying dead rows, {stops[True]} with")
    assert stops[True] < stops[False]


def test_dead_rows_are_carried_only_while_no_waiting_request_could_take_their_slots(model_dir):
    """``Scheduler.carries_dead_rows``: under uniform drafts, with nothing waiting, while at most
    half the step's rows are dead; not once a request waits unheld (it takes a slot at the
    stop), nor without uniform drafts (a step then takes each request's own K)."""
    engine = make(model_dir, True, k=2, uniform=True)
    s = engine.scheduler
    assert s.carries_dead_rows(1, 4) and s.carries_dead_rows(2, 4)
    assert not s.carries_dead_rows(3, 4), "most of the step's rows dead, carried"
    engine.add_request("w", PROMPTS[0], GREEDY)
    assert not s.holds_admissions() and not s.carries_dead_rows(1, 4), "carried while a request waits unheld"
    assert not make(model_dir, True, k=2).scheduler.carries_dead_rows(1, 4), "carried without uniform drafts"


def test_a_continuation_carries_dead_rows_only_when_told_and_never_runs_on_dead_rows_alone():
    """``continuation_blocker`` (host data only): a step whose request ended has no continuation
    unless told to carry dead rows; a carried dead row is not held to the live rows' checks (its
    tokens are dropped: a dead row near the context end or its max_tokens blocks nothing); a
    running request missing from the step, or a step of dead rows alone, is never continued."""
    from mtpserve.engine.pipeline import continuation_blocker
    from mtpserve.engine.request import Request
    from mtpserve.engine.scheduler import ScheduledRequest, StepLayout, StepPlan

    def request(i, length, max_tokens=64):
        r = Request(f"r{i}", [1] * 8, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        r.token_ids = [1] * length
        r.num_computed = length - 1
        return r
    requests = [request(0, 20), request(1, 95, max_tokens=87), request(2, 30)]   # r1: its last token, at the end
    scheduled = [ScheduledRequest(r, 1, 2) for r in requests]
    for s in scheduled:
        s.samples = True
    plan = StepPlan(scheduled=scheduled, layout=StepLayout.of(scheduled), request_ids=[r.request_id for r in requests])
    finished = "a request of the step finished, or a running one is not in it"

    def why(live, running, carry):
        return continuation_blocker(plan, running, False, lambda r, ahead: None, 100, 2, live=live, carry_dead=carry)
    assert why([True, False, True], 2, carry=False) == finished
    assert why([True, False, True], 2, carry=True) is None              # r1's context end and max_tokens: dead
    assert why([True, True, True], 3, carry=True) == "a request reaches the context end"     # r1 live: checked
    assert why([True, False, True], 3, carry=True) == finished          # a running request is not in the step
    assert why([False, False, False], 0, carry=True) == finished        # dead rows alone


def test_auto_calibrates_a_new_batch_size_in_runs_of_a_depth_launching_fewer_steps_alone(model_dir):
    """``--draft-tokens auto`` calibrates a batch size it has no step-cost fit for at depths 0
    and 1 by turns; overlapped, each change of depth stops the pipeline and the next step
    launches alone (on the H100 the bench flagged such steps at the start of auto loads, 3 of the
    5 runs read, at 3-6x their shape's median). An overlapped engine's policy holds each depth for runs of
    ``CALIBRATION_BURST`` steps: after 4 requests, 16 at once calibrate with a handful of steps
    launched alone instead of one every other step, and the tokens stay MTP off's."""
    from mtpserve.engine.draft_policy import AdaptiveDraftPolicy
    from mtpserve.engine.engine import CALIBRATION_BURST
    warm = [(f"w{i}", p, dataclasses.replace(GREEDY, max_tokens=8)) for i, p in enumerate(PROMPTS[:4])]
    load = [(f"r{i}", PROMPTS[i % len(PROMPTS)], dataclasses.replace(GREEDY, max_tokens=24)) for i in range(16)]
    plain = run(make(model_dir, False, budget=128), load)

    def calibrating(burst: int | None):
        engine = make(model_dir, True, k="auto", uniform=True, budget=128)
        if burst is not None:                     # (the scheduler plans with the policy it was built with)
            engine = Engine(engine.config, AdaptiveDraftPolicy(engine.max_drafts, calibration_burst=burst))
            engine.scheduler.uniform_drafts = True
        engine.draft_after_decode = True
        run(engine, warm)
        alone = []
        tokens = run(engine, load, during=lambda e, i: alone.append(
            i < 16 and e.last_step is not None and e.last_step.pipelined is False and not e.last_step.has_prefill))
        return tokens, sum(alone)

    assert CALIBRATION_BURST > 1
    runs, alone_runs = calibrating(None)            # the engine's own policy: overlapped, so in runs
    single, alone_single = calibrating(1)
    assert runs == plain and single == plain
    assert alone_single >= 5 and alone_runs <= alone_single - 3, (alone_runs, alone_single)


@pytest.mark.parametrize("prompt_graphs", [False, True])
def test_prompt_continuations_under_auto_drafting_keep_every_token(model_dir, prompt_graphs):
    """What ``mtpserve serve --device cuda`` runs by default: ``--draft-tokens auto`` with CUDA's
    rules (uniform drafts, holds, a draft step after a decode step), the early catch-up and
    prompt continuations; a closed loop of 9 clients over 24 requests of 8 prompts (prefix hits,
    chunked prompts) on 9 state rows, as the bench's pools, the policy choosing each step's
    depth: every token is MTP off's, pools checked after every step, and prompt steps were
    launched behind draft steps."""
    requests = closed_loop_requests()
    reference = closed_loop(make(model_dir, True), requests, 9)[0]
    engine = cuda_rules(model_dir, True, k="auto", hold=6, max_rows=9, prompt_graphs=prompt_graphs)
    assert closed_loop(engine, requests, 9)[0] == reference
    depths = dict(getattr(engine.draft_policy, "depths", {}))
    print(f"prompt graphs {prompt_graphs}: {engine.num_prompt_continuations} prompt continuations "
          f"({engine.num_prompts_followed} followed in flight); steps by depth {depths}")
    assert engine.num_prompt_continuations > 0
