"""What the MTP head is fed, on the real bundled model: its drafts equal a non-incremental
reference, step after step.

Output stays correct whatever the head is fed (verification sees to that), so a head fed the
wrong hidden rows only shows as lower acceptance. The reference recomputes every draft from
scratch: the main model over the whole sequence gives hidden[0..n-1]; head row j
pairs hidden[j] with token j+1, so a head forward over rows 0..n-1 gives d0 at its last row;
draft d(i) comes from a head forward over rows 0..n-1+i whose chained rows take d(i-1) and the
head's own hidden_states_out of the row before.
"""
from __future__ import annotations

import numpy as np

from mtpserve.engine.runner import PackedRows, Runner
from mtpserve.engine.sampler import SamplingParams

from test_engine import PROMPTS, make_engine, run_all

K = 3


def reference_drafts(runner: Runner, zero_states, tokens: list[int], num_drafts: int) -> list[int]:
    """Greedy drafts after `tokens` (the newest one not yet fed to the main model), from scratch."""
    n = len(tokens) - 1
    blocks = list(range(1, 1 + -(-(n + num_drafts) // runner.manifest.block_size)))
    main = runner.run_main([PackedRows(tokens[:n], 0, blocks)], zero_states, np.zeros(1, np.int32))
    hidden = np.array(main.hidden)
    ids = list(tokens[1:])
    drafts = []
    for _ in range(num_drafts):
        out = runner.run_head([PackedRows(ids, 0, blocks)], hidden)
        drafts.append(int(out.logits[-1].argmax()))
        ids.append(drafts[-1])
        hidden = np.concatenate([hidden[:n], np.array(out.hidden[n - 1:])])
    return drafts


def record_drafts(engine) -> list[tuple[list[int], int, list[int]]]:
    """Wrap the engine's draft proposal: (tokens at proposal time, drafts asked, drafts made) per request."""
    seen = []
    propose = engine.proposer.propose

    def recording(drafting):
        drafting = list(drafting)
        before = [(list(s.request.token_ids), s.num_drafts, s.request.request_id) for s in drafting]
        result = propose(drafting)
        seen.extend((tokens, k, result[rid].tokens) for tokens, k, rid in before)
        return result

    engine.proposer.propose = recording
    return seen


def test_head_drafts_equal_the_non_incremental_reference(model_dir):
    engine = make_engine(model_dir, k=K, budget=48)
    seen = record_drafts(engine)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    run_all(engine, [PROMPTS[0], PROMPTS[2], PROMPTS[13]], [params] * 3)
    assert len(seen) >= 12
    # catch-up spans of 1..K+1 rows (all rejected .. all accepted) must all have been drafted after
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    runner = Runner(engine.manifest, num_blocks=16)
    zero = engine.state_bank.spec.zero_states(1)
    for tokens, num_drafts, drafts in seen:
        assert drafts == reference_drafts(runner, zero, tokens, num_drafts), (
            f"drafts after {len(tokens)} tokens")


def test_drafts_after_an_eager_catch_up_of_long_head_rows_equal_the_reference(model_dir):
    """What captured drafting does for a request with more head rows to catch up than a graph
    takes (a new prompt, drafting resumed): all its rows but the last in one eager head forward
    first (``MTPProposer._catch_up_long``). Forced here on every request with 2 rows or more,
    the drafts still equal the reference: a row, position or hidden state out of place would
    change them."""
    engine = make_engine(model_dir, k=K, budget=48)
    proposer, propose = engine.proposer, engine.proposer.propose
    caught_up = []

    def catching_up(drafting):
        before = {s.request.request_id: s.request.num_head for s in drafting}
        proposer._catch_up_long([s.request for s in drafting])
        caught_up.extend(s.request.num_head - before[s.request.request_id] for s in drafting)
        return propose(drafting)

    proposer.propose = catching_up
    seen = record_drafts(engine)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    run_all(engine, [PROMPTS[0], PROMPTS[2], PROMPTS[13]], [params] * 3)
    assert max(caught_up) > 8 and sum(1 for n in caught_up if 0 < n <= K) >= 3   # prompts, and accepted drafts
    runner = Runner(engine.manifest, num_blocks=16)
    zero = engine.state_bank.spec.zero_states(1)
    for tokens, num_drafts, drafts in seen:
        assert drafts == reference_drafts(runner, zero, tokens, num_drafts), (
            f"drafts after {len(tokens)} tokens")
    engine.check_integrity()


def test_long_catch_ups_run_in_pieces_within_the_step_budget(model_dir):
    """A head catch-up longer than the step's token budget (a new prompt past it) runs in
    forwards of at most that many rows (the head's logits buffer is [rows, vocab]: one forward
    over a long prompt would hold far more than any step), and the drafts after it still equal
    the non-incremental reference. Forced into pieces of 5 rows on every request with 2 or more,
    so pieces of several requests share forwards."""
    budget = 16
    engine = make_engine(model_dir, k=K, budget=budget)
    proposer = engine.proposer
    assert proposer.max_rows == budget
    run_head, heads = engine.runner.run_head, []

    def counting(rows, hidden):
        heads.append((sum(len(r.token_ids) for r in rows), [r.past_len for r in rows]))
        return run_head(rows, hidden)

    engine.runner.run_head = counting
    seen = record_drafts(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["".join(PROMPTS[:6]), PROMPTS[2], PROMPTS[13] * 3]
    assert max(len(engine.tokenizer.encode(p)) for p in prompts) > 2 * budget
    run_all(engine, prompts, [params] * 3)
    assert max(n for n, _ in heads) <= budget, "a head forward past the step's budget"
    assert sum(1 for n, _ in heads if n == budget) >= 2, "the long prompts' catch-ups were not cut at the budget"
    runner = Runner(engine.manifest, num_blocks=64)
    zero = engine.state_bank.spec.zero_states(1)
    for tokens, num_drafts, drafts in seen:
        assert drafts == reference_drafts(runner, zero, tokens, num_drafts), f"drafts after {len(tokens)} tokens"
    engine.check_integrity()

    small = make_engine(model_dir, k=K, budget=48)
    small.proposer.max_rows = 5
    propose, shared = small.proposer.propose, []

    def in_pieces(drafting):
        small.proposer._catch_up_long([s.request for s in drafting])
        return propose(drafting)

    small.proposer.propose = in_pieces
    run_head_small = small.runner.run_head

    def counting_small(rows, hidden):
        shared.append([len(r.token_ids) for r in rows])
        return run_head_small(rows, hidden)

    small.runner.run_head = counting_small
    seen = record_drafts(small)
    run_all(small, [PROMPTS[0], PROMPTS[2], PROMPTS[13]], [params] * 3)
    assert max(sum(f) for f in shared) <= 5, "a forward of more than 5 rows"
    assert any(len(f) > 1 and max(f) > 1 for f in shared), "no forward held the pieces of several requests"
    for tokens, num_drafts, drafts in seen:
        assert drafts == reference_drafts(runner, zero, tokens, num_drafts), f"drafts after {len(tokens)} tokens"
    small.check_integrity()


def test_the_eager_drafting_forward_catches_up_apart_only_what_its_budget_needs():
    """Only the longest catch-ups run apart, and only until the drafting forward fits the budget:
    16 requests with 3 rows each and one with 100 under a budget of 60: the long one alone."""
    from mtpserve.engine.proposer import _longest_past

    class R:
        def __init__(self, rows):
            self.num_computed, self.num_head = 100 + rows, 100
    short, long = [R(3) for _ in range(16)], R(100)
    assert _longest_past([*short, long], 60) == [long]
    assert _longest_past(short, 60) == [], "48 rows fit"
    assert _longest_past([*short, long], 200) == [], "148 rows fit"
    assert len(_longest_past([*short, long], 20)) == 1 + 15, "148 rows - 99 - 15 x 2 = 19"
    assert _longest_past([R(1) for _ in range(30)], 10) == [], "rows of 1 cannot shrink"


class PaddedEagerFills:
    """``HeadGraphs``' catch-up fills as the CPU can run them: each group of pieces that
    ``GraphCatalog.fill_groups`` forms goes into one eager head forward, every piece padded to the
    group's row count as a captured fill pads it (rows past the piece: random ids and hidden
    rows, at the positions after the piece, on the scratch block past the request's blocks).
    ``draft`` finds no captured shape, so drafting itself stays eager."""

    catch_up_rows = 1 + K

    def __init__(self, runner, catalog, fill_counts, seed=0):
        self.runner, self.catalog, self.fill_counts = runner, catalog, fill_counts
        self.rng = np.random.default_rng(seed)
        self.padded_rows, self.group_sizes, self.longest = 0, [], 0

    def fill(self, rows, hidden):
        from mtpserve.engine.row_gather import stack_segments
        bs = self.runner.manifest.block_size
        self.longest = max([self.longest] + [len(r.token_ids) for r in rows])
        for group, _, n in self.catalog.fill_groups([len(r.token_ids) for r in rows], self.fill_counts):
            self.group_sizes.append(len(group))
            padded, states = [], []
            for i in group:
                r, pad = rows[i], n - len(rows[i].token_ids)
                table = list(r.block_table) + [0] * max(0, -(-(r.past_len + n) // bs) - len(r.block_table))
                padded.append(PackedRows(list(r.token_ids) + self.rng.integers(3, 1000, pad).tolist(), r.past_len, table))
                real = stack_segments(hidden[i], np)
                states.append(np.concatenate([real, self.rng.standard_normal((pad, real.shape[1])).astype(real.dtype)]))
                self.padded_rows += pad
            self.runner.run_head(padded, np.concatenate(states))
        return [i for i, r in enumerate(rows) if len(r.token_ids) > max(self.fill_counts)]

    def draft(self, *args, **kwargs):
        return None


def test_padded_catch_up_fills_leave_every_draft_as_the_reference(model_dir):
    """The rule ``HeadGraphs.fill`` rests on: a request's catch-up padded with garbage rows after
    it (their head KV past its committed positions, or on the scratch block) changes no draft,
    since the real row of each such position rewrites its KV before any row reads it. Emulated
    on the CPU (``PaddedEagerFills``: the same pieces, rounds and groups, each forward padded)
    with a new prompt and every request's catch-up of 2 or more rows forced through it: the
    drafts equal the non-incremental reference. (Padding placed one position earlier, over the
    last real row, fails this.)"""
    from mtpserve.engine.cuda_graphs import GraphCatalog
    engine = make_engine(model_dir, k=K, budget=48)
    proposer, propose = engine.proposer, engine.proposer.propose
    catalog = GraphCatalog((1, 2, 4, 8), (1, 1 + K, 8, 32), (64,), engine.manifest.block_size, banks=(0,), max_rows=64)
    proposer.graphs = fills = PaddedEagerFills(engine.runner, catalog, (8, 32))

    def catching_up(drafting):
        proposer._catch_up_long([s.request for s in drafting])
        return propose(drafting)

    proposer.propose = catching_up
    seen = record_drafts(engine)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    run_all(engine, [PROMPTS[0], PROMPTS[2], PROMPTS[13] * 3], [params] * 3)
    assert fills.padded_rows > 50 and max(fills.group_sizes) > 1     # padding, and pieces of several requests
    assert fills.longest == 32                                       # a 60-token prompt's catch-up in two rounds
    runner = Runner(engine.manifest, num_blocks=64)
    zero = engine.state_bank.spec.zero_states(1)
    for tokens, num_drafts, drafts in seen:
        assert drafts == reference_drafts(runner, zero, tokens, num_drafts), f"drafts after {len(tokens)} tokens"
    engine.check_integrity()
