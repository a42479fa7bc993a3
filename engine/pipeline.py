"""Overlapped decoding: the next step is launched before this step's tokens are read.

A step without drafts keeps every row it feeds, so its commit (state bank, KV lengths,
``num_computed``) does not depend on the tokens it samples: it is done when the step is
**launched**. Only appending the tokens, stops and outputs wait for them (the step **lands**).
A step whose requests all continue decoding can then be followed at once by its
**continuation**, whose input ids are the launched step's tokens, still on the device::

    host     | launch P | launch Q (ids: P's, on the device) | land P: wait, append, outputs | launch R ..
    device   | P forward, P argmax, P's copy out | Q forward, Q argmax, Q's copy out | R ..
                                               ^ the host works on P while the GPU runs Q

Without this the GPU waits for the host between steps (the accept's read, the commit's and
outputs' bookkeeping, the next schedule and launch): on the H200 at one request the 1.4 B
model's decode step replays in 1.98 ms and its TPOT was 2.5-2.64 ms without overlap, 2.09 with.

A continuation Q of the launched step P is taken (``continuation_blocker`` says why not) when:

- every request of P sampled in P (no prompt chunk left), needs nothing the host must compute
  from P's token first (penalties, a grammar, a min_tokens mask, logprobs), and can take one more
  token after P's (max_tokens, the context);
- P's requests are all the running ones and no waiting request could be admitted now (a free
  state row and no admission hold: ``Scheduler.admission_due``; else the scheduler decides the
  next step, after P lands);
- no request of P finished or was cancelled since P was launched (a **dead row**: its tokens are
  dropped when P lands, and its pool space is released then, not before: a release moves a state
  row, under a step that still writes it), unless P is a draft step and no waiting request
  could take a dead row's slot now: then Q carries the dead rows along (below);
- after a step without drafts, the draft policy plans none for the next step; after a draft
  step, one K for every request within the step's budget (see "Draft steps in flight" below).
  Otherwise the policy's answer is kept for the next schedule, after P lands, so none of its
  turns is skipped; with MTP on, a step without drafts hands its hidden rows to the proposer at
  launch;
- Q's KV fits (its rows, counted from P's longest acceptance, reserved now).

With MTP on, a step P that fed a prompt (it ran eagerly, so the GPU has little of it left when
its launch returns) lands first and the step call returns its events, first tokens included;
its continuation is launched at the start of the next step call (``Engine.land_prompts_first``),
with the rules above read for P landed. The first token then waits for P alone, not for Q's
launch as well (with MTP on, Q's head catches up on the whole prompt: on the H100, bundled
model, session 28, K=2's time to first token p50 fell from 4.1-4.5 to 3.2-3.3 ms at one request).

Tokens are picked on the device: greedy rows by one argmax kernel, sampled rows by the sampler's
own draws (``draw_tokens(on_device=True)``: a seeded request's keyed noise, any other's next
uniform from its RNG, in the order plain stepping draws them). A continuation with sampled
requests picks its tokens after P has landed (their positions count P's token; the sampler may
wait for the device, e.g. top-p's candidate check, and then waits on Q's forward with P's host
work already done); an all-greedy one picks them at its launch.

A request that finishes when P lands (a stop id, a stop string, max_tokens) is a dead row of Q:
its event goes out at once, its release waits until Q lands, and Q has no continuation, but for
one case (``Scheduler.carries_dead_rows``, under uniform drafts): while waiting requests are
held (``Scheduler.holds_admissions``, MTP on), or while none waits and at most half of P's rows
are dead, a draft step's continuation carries the dead rows along (their slots would stand
empty until a request is admitted anyway; on a captured step padding rows cost the same), so a
finish does not break the pipeline of draft steps: the rows are released when the pipeline
stops, at the next admission at the latest. (In the bench at C=16 on the H100, session 31,
with as many slots as clients, holds never held, so no dead row was carried and 344 of K=2's
1,854 steps stopped on a finish: ``holds_admissions`` has the fix.) A carried dead row is staged
from the host's lengths, which no longer advance. A draft step P whose tokens may end every one
of its requests (each has at most 1 + K tokens left) gets no continuation: Q could run on dead
rows alone, a whole step a waiting request would queue behind (at one request, every request's
last step; with waves, every wave's).
Greedy output is the same token for token with and without overlap: Q computes exactly the step
the scheduler would have planned next, from the same state.

**Draft steps in flight.** A greedy draft step P (every request 1 token + the same K drafts; no
penalties, grammar, min_tokens mask or logprobs: ``overlap_blocker``) is accepted and committed on
the device: the target rows' argmaxes against the drafts give each request's emitted tokens and
kept rows (``accept_drafts``; on the device ``cuda_kernels.accept_logits``, the argmaxes and the
acceptance in one launch), the state bank replays the rows
that keep fewer than 1 + K from those counts (``StateBank.commit_step_on_device``), and only those
two arrays go to the host. Its continuation Q (the policy plans one K' for all) is staged as if
P kept all its rows, and moved on the device::

    P's accepted [B, K + 2]    | e0 e1 .. eK | kept |       e_i: the tokens P emits (first ``kept``)
    Q's head catch-up          ids e0 .. eK at num_head + i; last real row at kept - 1; P's hidden rows
    Q's chained head rows      positions base + kept + i - 1     (staged: base + K + 1 + i - 1)
    Q's verify                 ids [e(kept-1), Q's drafts], positions base + kept + j (staged: + K + 1)

(``cuda_kernels.follow_catch_up`` / ``follow_verify``; base = P's num_computed, which the host
still has: lengths, ``num_computed`` and ``num_head`` advance when P lands, ``commit_lengths``.)
Q's KV is reserved for P's longest acceptance. Where no captured graph fits (or on the CPU) Q
reads P's acceptance first and runs from the host's copy. Rows of P that a request did not keep
hold KV that Q's rows overwrite before anything reads it.

**Prompt continuations** (``Engine.prompt_continuations``). Where a draft step P stops because
waiting requests are due (``admission_due``), the prompt step that admits them can instead be
launched as P's continuation Q, with P's requests in it as decode rows, so the GPU does not wait
for P to land and the host to plan and launch Q (on the H100, bundled model, C=16, session 38:
0.79 ms a prompt step, K=0 0.39)::

    Q's rows      | P's live requests: one row each             | admitted: prompt chunks |
    staged        ids 0, position base + K + 1 (as if P kept all)    as a prompt step's
    moved         id e(kept-1), position base + kept (``follow_verify``, one row a request)

P's dead rows (requests that ended when the step before P landed) are released first: the
release is queued behind P's commit, so their state rows and blocks are free for the arrivals
(with as many state rows as clients there is no other row) and a moved request's acceptance row
is gathered where the release moved its state row. A captured prompt step needs the requests on
state rows ``0 .. B-1`` of one bank (``PromptGraphs.run(follow=...)``); elsewhere Q reads P's
acceptance and runs from the host's copy (on the CPU that costs nothing). Q's commit is a prompt
step's, at its launch: a commit adds to the lengths, and P's own follow when P lands, in the same
step call, before anything reads them. The head's hidden rows of the moved requests are kept at
the start of the next step call, behind P's kept rows; an admitted request's at Q's launch
(``early_head_catch_up`` reads them there). With the head caught up at Q's launch and every
prompt of Q complete, Q is followed before it lands by a draft step, as a decode step is
(``draft_after_decode``); else Q lands first (``land_prompts_first``) and its continuation runs
on its live requests. Either way the tokens are those of stopping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mtpserve.engine import launches
from mtpserve.engine.scheduler import StepLayout, StepPlan


class TokenReadback:
    """A step's sampled token ids, device -> host without waiting at the copy: two pinned slots
    used in turn (a step lands before the one after next is launched), each with an event. On
    the CPU the tokens are host arrays already.

    ``wait_s`` adds up the time ``receive`` blocked because the copy was not done yet: in an
    overlapped loop, the host ahead of the device (near zero: the loop is host-bound, its steps
    as long as its host work)."""

    def __init__(self, max_rows: int, xp):
        self.xp, self.max_rows = xp, max_rows
        self.wait_s = 0.0
        if xp is np:
            return
        import cupy
        self._pinned = [cupy.cuda.alloc_pinned_memory(8 * max_rows) for _ in range(2)]
        self._host = [np.frombuffer(p, np.int64, max_rows) for p in self._pinned]
        self._done = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
        self._next = 0

    def send(self, tokens) -> tuple:
        """Start the copy of ``tokens`` (int64 [B], on the device) to the host; a handle for ``receive``."""
        if self.xp is np:
            return (np.asarray(tokens, np.int64),)
        import cupy
        n = int(tokens.shape[0])
        if n > self.max_rows:
            raise AssertionError(f"{n} tokens > the readback's {self.max_rows} rows")
        slot, self._next = self._next, 1 - self._next
        tokens = cupy.ascontiguousarray(tokens, cupy.int64)
        launches.copy(self._host[slot].ctypes.data, tokens.data.ptr, 8 * n, cupy.cuda.runtime.memcpyDeviceToHost)
        launches.record(self._done[slot])
        return slot, n

    def receive(self, handle: tuple) -> np.ndarray:
        """The tokens of ``send``'s handle, once the copy is done (waits for it)."""
        if self.xp is np:
            return handle[0]
        slot, n = handle
        done = self._done[slot]
        if not done.done:              # (one query when the copy is done: no clock read)
            started = time.perf_counter()
            done.synchronize()
            self.wait_s += time.perf_counter() - started
        return self._host[slot][:n].copy()


@dataclass
class LaunchedStep:
    """A step whose device work is queued and whose commit is done, but whose tokens are not read.

    A draft step (``num_drafts`` = K > 0) is committed on the device only (its state rows, by
    its accepted counts there); the host's lengths and tokens follow when it lands."""
    plan: StepPlan
    graphed: bool                   # its forward replayed a captured graph
    logits: object = None           # its (processed) logits, until its tokens are picked
    tokens: object = None           # int64 [B]: request i's token (greedy: its target row's argmax; sampled:
                                    # drawn on the device), once picked; a draft step: ``accepted``
    readback: tuple | None = None   # TokenReadback handle of ``tokens``
    num_drafts: int = 0             # K of a draft step (every request verified K drafts)
    hidden: object = None           # its main hidden rows (MTP on; a draft step's [B * (K + 1), H]): the head's next catch-up
                                    # (a captured draft continuation's: rows of the replays' own buffer, copied when it lands
                                    # unfollowed, ``StepGraphs.shares``)
    followed: bool = False          # a draft step's continuation caught the head up on its rows
    num_head_rows: int = 0          # head rows its drafting caught up on (the step's timing)
    num_moved: int = 0              # a prompt continuation: its first ``num_moved`` requests, the draft step's
                                    # before it, fed one row each, moved on the device by its acceptance
    staging: object = None          # its captured forward's ``cuda_graphs.StagedStep`` (None: eager, or
                                    # its continuation carries a dead row: not staged from it)
    source: TokenReadback | None = field(default=None, repr=False)    # where ``tokens`` were sent
    _host: np.ndarray | None = field(default=None, repr=False)
    _accepted: object = field(default=None, repr=False)

    def rows_of(self, keep: list[int], xp) -> LaunchedStep:
        """This landed step without drafts over its requests ``keep`` alone (indices, in the order
        given): the same hidden rows, its tokens gathered (a prompt continuation whose dead rows
        were released when it landed: its continuation runs on the live requests, in state-row
        order, as if they had been the step's)."""
        assert not self.num_drafts and self._host is not None, "a landed step without drafts"
        p, at = self.plan, np.array(keep, np.int64)
        scheduled = [p.scheduled[i] for i in keep]
        layout = StepLayout([p.layout.row_start[i] for i in keep], [p.layout.num_rows[i] for i in keep],
                            [p.layout.target_row[i] for i in keep])
        plan = StepPlan(scheduled=scheduled, layout=layout, request_ids=[p.request_ids[i] for i in keep])
        host = self._host[at]             # (landed: its tokens go back from the host, not by a gather kernel)
        return LaunchedStep(plan, self.graphed, tokens=xp.asarray(host), hidden=self.hidden, _host=host)

    def accepted(self):
        """The step's acceptance as a draft step's ``tokens`` are laid out, on the device: a draft
        step's own; a decode step's as a draft step with no drafts would have it, ``[token, 1]`` a
        request (so that a draft step can follow it: ``Engine.draft_after_decode``)."""
        if self.num_drafts:
            return self.tokens
        if self._accepted is None:
            if isinstance(self.tokens, np.ndarray):
                self._accepted = _decode_as_accepted(self.tokens)
            else:
                from mtpserve.engine.cuda_kernels import decode_as_accepted
                self._accepted = decode_as_accepted(self.tokens)
        return self._accepted

    def host_accepted(self) -> np.ndarray:
        """``accepted()`` on the host (the first call waits for the step's copy)."""
        return self.host_tokens() if self.num_drafts else _decode_as_accepted(self.host_tokens())

    def host_tokens(self) -> np.ndarray:
        """The tokens on the host (the first call waits for the copy); a draft step's ``[B, K + 2]``:
        request i's emitted tokens ``[i, :kept]``, then ``kept`` at ``[i, K + 1]``."""
        if self._host is None:
            self._host = self.source.receive(self.readback)
            if self.num_drafts:
                self._host = self._host.reshape(len(self.plan.scheduled), self.num_drafts + 2)
        return self._host


def _decode_as_accepted(tokens: np.ndarray) -> np.ndarray:
    """A decode step's tokens ``[B]`` as a draft step's acceptance with no drafts: ``[token, 1]``
    a request (``cuda_kernels.decode_as_accepted`` on the device)."""
    return np.stack([tokens.astype(np.int64), np.ones(len(tokens), np.int64)], axis=1)


def follow_verify_host(accepted: np.ndarray, num_kept_staged: int, num_rows: int, past: np.ndarray,
                       positions: np.ndarray, ids: np.ndarray) -> None:
    """``cuda_kernels.follow_verify`` on host arrays (a prompt continuation's staging on the CPU,
    ``PromptGraphs``): the first ``B = len(accepted)`` requests, ``num_rows`` rows each, moved
    from positions staged for ``num_kept_staged`` kept rows to the accepted ones, and row 0 of
    each := the accepted step's last emitted token."""
    B = len(accepted)
    kept = accepted[:, num_kept_staged].astype(np.int64)
    past[:B] += (kept - num_kept_staged).astype(past.dtype)
    rows = np.arange(B * num_rows)
    positions[:, rows] += np.repeat(kept - num_kept_staged, num_rows)[None, :]
    ids[rows[::num_rows]] = accepted[np.arange(B), kept - 1]


def accept_drafts(target: np.ndarray, drafts: np.ndarray, synthetic: np.ndarray | None = None):
    """A uniform draft step's greedy acceptance as arrays, the host's version of
    ``cuda_kernels.accept_drafts`` and ``accept_logits`` (and their reference): ``target``
    [B, K + 1] the target rows' argmaxes, ``drafts`` [B, K]; ``synthetic`` [B]: accepted counts
    given (benchmarks).
    Returns ``(accepted [B, K + 2], kept [B])``::

        drafts     d0 d1 d2           target  t0 t1 t2 t3       d0 == t0, d1 != t1: 1 accepted
        accepted   d0 t1 t2 t3 | 2    (emitted: d0 t1; t2 t3 would follow a longer acceptance)
    """
    B, K = drafts.shape
    if synthetic is None:
        n = np.cumprod(drafts == target[:, :K], axis=1).sum(axis=1) if K else np.zeros(B, np.int64)
    else:
        n = np.asarray(synthetic, np.int64)
    cols = np.arange(K + 1)[None, :]
    padded = np.concatenate([drafts, np.zeros((B, 1), np.int64)], axis=1)
    accepted = np.empty((B, K + 2), np.int64)
    accepted[:, :K + 1] = np.where(cols < n[:, None], padded, target)
    accepted[:, K + 1] = n + 1
    return accepted, accepted[:, K + 1].copy()


def overlap_blocker(plan: StepPlan, picks_on_host, host_rule) -> str | None:
    """Why a scheduled step must run to its end before anything else (None: it may be launched
    and land later). ``picks_on_host(s)``: why scheduled request s's part of the step needs the
    host to pick or score a token from its logits after the step (logprobs), or None;
    ``host_rule(r, 0)``: why request r's logits need the host (penalties, a grammar, a
    min_tokens mask), which a draft step's device accept does not apply."""
    drafts = plan.scheduled[0].num_drafts if plan.scheduled else 0
    for s in plan.scheduled:
        if drafts:
            if s.num_drafts != drafts or s.num_tokens != 1:
                return "the step's draft counts differ"
            if not s.request.params.is_greedy:
                return "a sampled request verifies drafts"
            why = host_rule(s.request, 0)
            if why is not None:
                return why
        elif s.num_drafts:
            return "the step's draft counts differ"
        why = picks_on_host(s)
        if why is not None:
            return why
    return None


# continuation_blocker's reasons that a prompt continuation may take over (``Engine.prompt_continuations``)
ADMISSION_DUE = "a waiting request can be admitted"
FINISHED = "a request of the step finished, or a running one is not in it"


def continuation_blocker(plan: StepPlan, num_running: int, can_admit: bool,
                         host_rule, context_length: int, num_drafts: int = 0, landed: bool = False,
                         live: list[bool] | None = None, carry_dead: bool = False) -> str | None:
    """Why the launched step ``plan`` cannot be followed by its continuation now (None: it can;
    see the module docstring). ``num_running``: the scheduler's running requests (a request of
    the step that finished since its launch is not one, so a dead row stops it); ``host_rule(r,
    ahead)``: why request r's logits from its output position ``ahead`` on need the host first
    (penalties, grammar, a min_tokens mask), or None; ``num_drafts``: the most drafts the
    continuation may carry (its rows must stay inside the context); ``landed``: the step has
    landed already, its tokens appended (``Engine.land_prompts_first``). ``live``: whether each
    request of the step still runs (None: all); ``carry_dead``: the rows of those that ended may
    ride along (``Scheduler.carries_dead_rows``: no waiting request could take their slots
    now). The reason names no request: it is a count's key (``Engine.overlap_blockers``).
    Host data only: no GPU or pool in here."""
    num_live = len(plan.scheduled) if live is None else sum(live)
    if num_live != num_running or not num_live or (num_live < len(plan.scheduled) and not carry_dead):
        return FINISHED
    if can_admit:
        return ADMISSION_DUE
    # tokens the step may still append (at least one: it samples; none once it landed)
    ahead = 0 if landed else 1 + plan.scheduled[0].num_drafts if plan.scheduled else 1
    all_may_end = ahead > 1
    for i, s in enumerate(plan.scheduled):
        if live is not None and not live[i]:           # a dead row carried: nothing of it is read
            continue
        r = s.request
        if not s.samples:              # (only a decode step's requests sample all: no prompt chunk)
            return "a request fed a prompt chunk"
        why = host_rule(r, min(ahead, 1))
        if why is not None:
            return why
        if len(r.token_ids) + ahead + 1 + num_drafts > context_length:
            return "a request reaches the context end"
        if ahead == 1 and r.max_output_left <= 1:     # (a saving: a draft step's may end with a dead row)
            return "a request ends with the step's token"
        all_may_end = all_may_end and r.max_output_left <= ahead
    if all_may_end:
        # the draft step may end every request: its continuation could run on dead rows alone, a
        # whole step of GPU time that a waiting request's prompt would queue behind
        return "every request may end with the step's tokens"
    return None
