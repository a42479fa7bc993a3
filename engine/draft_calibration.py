"""Timing every decode step ``--draft-tokens auto`` can choose, at start-up: the draft policy's
step-cost table (``step_costs.StepCostTable``).

For each batch size in ``calibration_sizes`` (1, 2, 4, ... and the step's request limit) and
each draft depth 0..max, the engine starts that many made-up requests and, once they all
decode, holds the depth for ``steps`` steps in a row under a fixed policy, then times joins::

    size n, depth d:  n prompts | steps | join | join | join | abort all
                                  ^^ the first `skip` steps are left out: the first runs alone
                                     (overlapped decoding launches a step of one kind behind
                                     another of its kind) and catches up the head

Fresh requests at each depth keep what one needs small (its prompt and one depth's tokens: 17
blocks of 16 with the defaults and 4 drafts; 30 when every depth ran on the same ones), so a
pool sized for the served load holds the largest size too.

A depth's time is the median of its kept steps' wall time (``StepTiming.seconds``) that ran
behind another (``pipelined``; all of them without overlap): the cost a depth has while
held, which is what a policy that holds it pays.

A join ends one request and starts another (a fresh prompt of ``prompt_len`` tokens), and
times the steps from there to ``join_steps`` past its prompt's last step: the prompt's steps,
the new request's first drafts (its head catches up on the whole prompt), the steps that run
alone until the overlap is back. What those cost beyond as many steady steps, more than at
depth 0 (whose joins pay the prompt's steps too), is the join price of a drafting step at that
size (``StepCostTable`` ``joins``; one price for every depth, the median over all of theirs).

Requests are aborted at the end; the engine is idle and empty again, and nothing the requests
did reaches the adaptive policy (the fixed one hears their verifies). A depth whose step
would not fit the step's token budget (n * (1 + d) rows) is priced infinite: the scheduler
would cut its drafts, so no policy can choose it.

On a 2-core CPU, 3 sizes of the bundled model took 3.5-3.7 s (1.8-2.7 s when every depth ran on
one set of requests); on the H200 it has not been timed yet (the log says how long). ``Engine`` runs it when auto drafts and
``SpecConfig.draft_calibration`` is on, and logs the table.
"""

from __future__ import annotations

import itertools
import logging
import math
import time

import numpy as np

from mtpserve.engine.draft_policy import FixedDraftPolicy
from mtpserve.engine.sampler import SamplingParams
from mtpserve.engine.step_costs import StepCostTable

logger = logging.getLogger(__name__)


def calibration_sizes(largest: int) -> tuple[int, ...]:
    """Powers of two below ``largest``, and ``largest`` itself."""
    sizes, n = [], 1
    while n < largest:
        sizes.append(n)
        n *= 2
    return tuple(sizes + [max(1, largest)])


def time_draft_depths(engine, sizes, steps: int = 12, skip: int = 2, prompt_len: int = 64,
                      seed: int = 0, join_steps: int = 5, num_joins: int = 3) -> StepCostTable:
    """The table of ``engine``'s decode steps at each size in ``sizes`` and depth
    0..``engine.max_drafts`` (see the module docstring). Sizes whose requests the KV pool or the
    resident rows cannot hold at once are left out (logged); ValueError when none fits or the
    engine has no MTP head."""
    if engine.max_drafts < 1:
        raise ValueError("timing draft depths needs an engine with an MTP head and draft_tokens auto or > 0")
    if steps <= skip + 1:
        raise ValueError(f"steps must exceed skip + 1 ({skip + 1}), got {steps}")
    depths = range(engine.max_drafts + 1)
    m = engine.manifest
    budget = engine.config.scheduler.max_tokens_per_step
    # each depth starts its own requests; one of them takes part in at most the depth's steps and
    # every join's window (its prompt's chunks beside n - 1 decodes, join_steps, and slack for a
    # step that lands late or a chunk cut at a snapshot boundary), each keeping up to 1 + d tokens
    def window_steps(n: int) -> int:
        return -(-prompt_len // max(1, budget - n + 1)) + join_steps + 3
    max_tokens = (steps + num_joins * window_steps(max(sizes))) * (1 + engine.max_drafts) + engine.max_drafts + 1
    prompt_len = min(prompt_len, m.context_length - max_tokens - 1)
    if prompt_len < 1:
        raise ValueError(f"the context ({m.context_length} tokens) is too short to time {steps} steps a depth")
    blocks = -(-(prompt_len + max_tokens) // m.block_size)
    fits = [n for n in sizes if n * blocks <= engine.kv_pool.num_usable_blocks
            and n <= engine.config.cache.max_resident_requests]
    if len(fits) < len(sizes):
        logger.warning("engine: timing draft depths at %s requests only (the KV pool holds %d blocks, %d a request)",
                       fits, engine.kv_pool.num_usable_blocks, blocks)
    if not fits:
        raise ValueError("the KV pool cannot hold even one request's calibration")
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    samples: dict[tuple[int, int], list[float]] = {}
    windows: dict[tuple[int, int], list[float]] = {}        # join windows' seconds over steady steps
    policy = engine.scheduler.draft_policy
    started = time.perf_counter()
    serial = itertools.count()

    def start_request() -> str:
        rid = f"<draft-calibration-{next(serial)}>"
        engine.add_request(rid, rng.integers(0, m.vocab_size, prompt_len).tolist(), params)
        return rid

    def start_batch(n: int) -> list[str]:
        engine.scheduler.draft_policy = FixedDraftPolicy(0)
        ids = [start_request() for _ in range(n)]
        for _ in range(n * prompt_len + 8):              # until every prompt is in
            engine.step()
            t = engine.last_step
            if t is not None and not t.has_prefill and t.num_requests == n:
                break
        return ids

    def end_batch(ids: list[str]) -> None:
        for rid in ids:
            engine.abort(rid)
        while engine.has_work:                            # a launched step lands
            engine.step()
    try:
        for n in fits:
            for d in depths:
                if n * (1 + d) > budget:       # the scheduler cuts such steps' drafts: never run
                    samples[n, d] = [math.inf]
                    continue
                ids = start_batch(n)
                engine.scheduler.draft_policy = FixedDraftPolicy(d)
                held, alone = [], []
                for i in range(steps):
                    engine.step()
                    t = engine.last_step
                    if i < skip or t is None or t.has_prefill or t.num_requests != n or t.num_head_forwards != d:
                        continue
                    (alone if t.pipelined is False else held).append(t.seconds)
                # a depth that never ran behind another runs alone live too: its alone time
                samples[n, d] = held if len(held) >= 3 else held + alone
                steady = float(np.median(samples[n, d])) if samples[n, d] else 0.0
                for _ in range(num_joins):
                    engine.abort(ids.pop(0))
                    ids.append(start_request())
                    window, num_steps, decoding = 0.0, 0, 0
                    while decoding < join_steps and num_steps < window_steps(n):
                        engine.step()                 # the prompt's steps, then join_steps more
                        t = engine.last_step
                        num_steps += 1
                        window += t.seconds if t is not None else 0.0
                        decoding = 0 if t is not None and t.has_prefill else decoding + 1
                    windows.setdefault((n, d), []).append(window - num_steps * steady)
                end_batch(ids)
            logger.info("engine: %d requests a step: %s ms by draft depth", n,
                        " ".join(f"{np.median(samples[n, d]) * 1e3:.2f}" if samples[n, d] else "-" for d in depths))
            if not any(math.isfinite(x) for d in depths if d for x in samples[n, d]):
                break                           # a larger size has no drafting depth either
    finally:
        engine.scheduler.draft_policy = policy
    assert engine.is_idle_and_empty(), "draft calibration left something behind"
    missing = [key for key, v in samples.items() if not v]
    if missing:
        raise RuntimeError(f"draft calibration timed no step at (size, depth) {missing}")
    # one join price for every depth >= 1 at a size, the median of all their joins: what a join
    # adds (the head's catch-up on the prompt, steps run alone) hardly depends on the depth,
    # and 3 joins a depth alone were noisy (on this CPU: 0 to 6.8 ms between depths of one size)
    joins = {}
    for n in fits:
        drafting = [w for d in depths if d for w in windows.get((n, d), [])]
        if drafting and windows.get((n, 0)):
            price = float(np.median(drafting)) - float(np.median(windows[n, 0]))
            joins.update({(n, d): [price] for d in depths if d})
    table = StepCostTable.from_samples(samples, joins, max_rows=budget)
    logger.info("engine: timed draft depths 0..%d at %d batch sizes in %.1f s; a joining request costs %s ms "
                "more by depth at %d requests", engine.max_drafts, len(fits), time.perf_counter() - started,
                " ".join(f"{x * 1e3:.2f}" for x in table.join_seconds(fits[-1])), fits[-1])
    return table
