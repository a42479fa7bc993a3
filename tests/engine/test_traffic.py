"""Random traffic through the whole engine against requests run alone.

Each example is one engine (MTP at K=1..3 or auto, the prefix cache on, pools and a step budget
from roomy to tight enough to force chunked prefill, queueing, preemption and eviction) and a
sequence of operations: add requests (prompts drawn from a small pool that shares prefixes and
repeats, so entries are created, hit, evicted and poisoned A -> B -> A; some with penalties,
stop ids to meet inside accepted draft runs after min_tokens, or EOS), run some steps, abort a
live request. Whatever happened around it, every request that was not aborted, greedy or seeded
sampled, must emit exactly the MTP-off, cache-off engine's tokens for it alone. The pools pass
their integrity checks after every step and are empty at the end.

The examples are derandomized (the same ones every run, so CI cannot flake on a new draw);
``MTPSERVE_TRAFFIC_EXAMPLES=N`` runs N of them, e.g. to hunt locally.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtpserve.engine.grammar import GrammarSpec
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.tokenizer import Tokenizer

from test_engine import PROMPTS, check_no_drafts_beside_a_prompt, make_engine

MAX_TOKENS = 32
NUM_PROMPTS = 10
MAX_STEPS = 3000
try:
    import xgrammar  # noqa: F401 - structured output's library (the test extra has it)
    HAS_GRAMMARS = True
except ImportError:
    HAS_GRAMMARS = False            # far beyond any example's need: an engine that never finishes fails


@pytest.fixture(scope="module")
def prompt_pool(model_dir):
    """NUM_PROMPTS token prompts: shared prefixes of 0-5 blocks (16 tokens each) plus suffixes."""
    ids = Tokenizer(model_dir).encode("".join(PROMPTS) * 2)
    pool = []
    for i in range(NUM_PROMPTS):
        prefix = ids[:(0, 24, 40, 80)[i % 4]]            # mid-block and block-aligned prefixes
        start = 100 + 7 * (i // 2)                       # pairs share their suffix's start too
        pool.append(prefix + ids[start:start + 3 + 5 * (i % 3)])
    return pool


class References:
    """Each request's output alone on an MTP-off, cache-off engine, computed once."""

    def __init__(self, model_dir, pool):
        self.pool, self.outputs = pool, {}
        self.engine = make_engine(model_dir, k=0, prefix_cache=False)

    def __call__(self, prompt: int, params: SamplingParams) -> tuple[list[int], list]:
        """(tokens, logprob entries) of the request alone."""
        key = (prompt, params)
        if key not in self.outputs:
            self.engine.add_request("alone", self.pool[prompt], params)
            tokens, entries = [], []
            while self.engine.has_work:
                for ev in self.engine.step():
                    tokens.extend(ev.token_ids)
                    entries.extend(ev.logprobs or [])
            self.outputs[key] = tokens, entries
        return self.outputs[key]


@pytest.fixture(scope="module")
def references(model_dir, prompt_pool):
    return References(model_dir, prompt_pool)


# what a request asks beside its sampling: nothing; penalties (the logits depend on its history,
# drafts included); stop ids it may meet inside an accepted draft run, after min_tokens; EOS
# (logprobs: the target's distribution at each emitted token, an accepted draft's from the row
# that checked it); a grammar (its matcher rolled back past rejected drafts, rebuilt on preemption)
EXTRAS = ({}, {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2},
          {"stop_token_ids": (19, 22, 231, 413), "min_tokens": 3}, {"ignore_eos": False, "min_tokens": 2},
          {"logprobs": 2}, {"grammar": GrammarSpec("regex", r"[a-z_]{1,12}(\.[a-z_]{1,12})*\([a-z0-9, ]{0,40}\)")})


def _params(max_tokens: int, seed: int | None, extra: int) -> SamplingParams:
    sampling = {"temperature": 0} if seed is None else {"temperature": 0.9, "top_p": 0.95, "seed": seed}
    asked = {"ignore_eos": "grammar" not in EXTRAS[extra], **sampling, **EXTRAS[extra]}   # a grammar ends with EOS
    if "min_tokens" in asked:
        asked["min_tokens"] = min(asked["min_tokens"], max_tokens)
    return SamplingParams(**asked, max_tokens=max_tokens)


adds = st.tuples(st.just("add"), st.integers(0, NUM_PROMPTS - 1), st.integers(1, MAX_TOKENS),
                 st.one_of(st.none(), st.none(), st.integers(0, 3)),      # a third seeded sampled
                 st.integers(1, 6),                                        # prompts i, i+1, ... at once
                 st.sampled_from([0, 0, 1, 2, 3, 4, 5] if HAS_GRAMMARS else [0, 0, 1, 2, 3, 4]))   # EXTRAS
ops = st.lists(st.one_of(adds, adds, st.tuples(st.just("step"), st.integers(1, 6)),
                         st.tuples(st.just("abort"), st.integers(0, 63))), min_size=6, max_size=30)

configs = st.fixed_dictionaries({
    "k": st.sampled_from([1, 2, 3, "auto"]),
    "num_blocks": st.sampled_from([10, 14, 24, 512]),    # 10: room for one long request
    "max_rows": st.sampled_from([2, 4, 16]),
    "budget": st.sampled_from([12, 40, 128]),
    "uniform": st.booleans(),          # one K a step, as with CUDA graphs (drafts past max_tokens dropped)
})


@settings(max_examples=int(os.environ.get("MTPSERVE_TRAFFIC_EXAMPLES", "16")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(config=configs, operations=ops)
def test_random_traffic_emits_what_each_request_emits_alone(model_dir, prompt_pool, references, config, operations):
    engine = make_engine(model_dir, k=config["k"], num_blocks=config["num_blocks"], max_rows=config["max_rows"],
                         budget=config["budget"], batch=config["max_rows"])
    engine.scheduler.uniform_drafts = config["uniform"]
    added, tokens, entries, finished, aborted = {}, {}, {}, set(), set()

    def step() -> None:
        for ev in engine.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            entries.setdefault(ev.request_id, []).extend(ev.logprobs or [])
            if ev.finish_reason is not None:
                finished.add(ev.request_id)
        engine.check_integrity()
        check_no_drafts_beside_a_prompt(engine)

    for op in operations:
        if op[0] == "add":
            _, first, max_tokens, seed, copies, extra = op
            for prompt in (p % NUM_PROMPTS for p in range(first, first + copies)):
                rid = f"r{len(added)}"
                params = _params(max_tokens, seed, extra)
                engine.add_request(rid, prompt_pool[prompt], params)
                added[rid] = (prompt, params)
        elif op[0] == "step":
            for _ in range(op[1]):
                if engine.has_work:
                    step()
        else:
            live = sorted(set(added) - finished - aborted)
            if live:
                rid = live[op[1] % len(live)]
                engine.abort(rid)
                aborted.add(rid)
                engine.check_integrity()
    for _ in range(MAX_STEPS):
        if not engine.has_work:
            break
        step()
    assert not engine.has_work, f"the engine did not finish in {MAX_STEPS} steps"
    assert engine.is_idle_and_empty(), "pools not back to empty after every request ended"
    assert finished | aborted == set(added)
    for rid, (prompt, params) in added.items():
        if rid in aborted:
            continue
        want, want_entries = references(prompt, params)
        assert tokens.get(rid, []) == want, (rid, prompt, params, config, operations)
        got_entries = entries.get(rid, [])
        assert [(t, [b for b, _ in best]) for t, _, best in got_entries] == \
            [(t, [b for b, _ in best]) for t, _, best in want_entries], (rid, params, config)
        for (_, lp, best), (_, want_lp, want_best) in zip(got_entries, want_entries):
            assert lp == pytest.approx(want_lp, abs=1e-4)          # other batch shapes: float rounding only
            assert [v for _, v in best] == pytest.approx([v for _, v in want_best], abs=1e-4)
