"""MTP at the end of a request, on the real bundled model: near max_model_len and max_tokens the
output equals MTP off, ends exactly at the limit, and no step feeds or reserves past it.

The planner caps a request's drafts by what it may still emit; without that cap the output would
still be right (the commit cuts at the limit) but the step would feed rows past the context and
reserve KV blocks for them, so the test watches every plan and every block table.
"""
from __future__ import annotations

import pytest

from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from mtpserve.engine.engine import Engine
from mtpserve.engine.kv_pool import cdiv
from mtpserve.engine.request import FinishReason
from mtpserve.engine.sampler import SamplingParams

from test_engine import PROMPTS, run_requests

MAX_MODEL_LEN = 64
# (prompt tokens, max_tokens): the first four end at max_model_len, the last two at max_tokens
SHAPES = [(20, 500), (33, 500), (47, 500), (62, 500), (10, 38), (21, 11)]


def limit_engine(model_dir, k):
    return Engine(EngineConfig(str(model_dir), num_threads=2, max_model_len=MAX_MODEL_LEN,
                               cache=CacheConfig(num_blocks=64, max_resident_requests=8),
                               scheduler=SchedulerConfig(max_tokens_per_step=256, max_requests_per_step=8),
                               spec=SpecConfig(draft_tokens=k)))


def run_to_the_limits(engine, prompts):
    """Step every request to its end; checks each plan and each block table against the limits.

    Returns (tokens, reasons, number of planned decodes whose drafts the limit cut below K).
    """
    k = engine.config.spec.num_draft_tokens
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _, max_tokens in SHAPES]
    limits = {f"r{i}": min(len(ids) + p.max_tokens, MAX_MODEL_LEN) for i, (ids, p) in enumerate(zip(prompts, params))}
    capped = 0
    schedule = engine.scheduler.schedule

    def checked_schedule():
        nonlocal capped
        plan = schedule()
        for s in plan.scheduled:
            r = s.request
            end = r.num_computed + s.num_tokens + s.num_drafts
            assert end <= limits[r.request_id], f"{r.request_id} feeds rows up to {end}"
            if r.is_decoding and len(r.token_ids) + k > limits[r.request_id]:
                capped += 1
        return plan

    engine.scheduler.schedule = checked_schedule

    def check_blocks(engine):
        for pool in (engine.kv_pool, engine.head_pool):
            for rid in (pool.request_ids if pool is not None else []):
                blocks = len(pool.block_table(rid))
                assert blocks <= cdiv(limits[rid], pool.block_size), f"{rid} holds {blocks} blocks"

    tokens, reasons, _ = run_requests(engine, prompts, params, after_step=check_blocks)
    return tokens, reasons, capped


@pytest.fixture(scope="module")
def prompts(model_dir):
    ids = limit_engine(model_dir, 0).tokenizer.encode("".join(PROMPTS))
    return [ids[i * 7:i * 7 + n] for i, (n, _) in enumerate(SHAPES)]


@pytest.fixture(scope="module")
def mtp_off(model_dir, prompts):
    return run_to_the_limits(limit_engine(model_dir, 0), prompts)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mtp_output_ends_exactly_at_max_model_len_and_max_tokens(model_dir, prompts, mtp_off, k):
    tokens_off, _, _ = mtp_off
    tokens, reasons, capped = run_to_the_limits(limit_engine(model_dir, k), prompts)
    assert tokens == tokens_off
    for i, (ids, (_, max_tokens)) in enumerate(zip(prompts, SHAPES)):
        assert len(ids) + len(tokens[f"r{i}"]) == min(len(ids) + max_tokens, MAX_MODEL_LEN)
        assert reasons[f"r{i}"] == FinishReason.LENGTH
    if k > 1:
        assert capped > 0, "no step came near a limit with drafts to cut"
