"""The MTP proposer: the head's catch-up on committed rows, then K chained single-row drafts.

Head rows pair the main model's hidden state at position p with the token at p + 1 and predict
the token at p + 2:

    position p        ...  n-2        n-1        | n           n+1     ...
    head input id          t[n-1]     t[n]       | d0          d1
    head hidden            main[n-2]  main[n-1]  | out[n-1]    out[n]
    head predicts          t[n]       d0         | d1          d2
                      '-- catch-up: [num_head, n) --'-- chained: n .. n+K-2 --'

(n = num_computed; t[n] is the newest token, not yet fed to the main model.) Catch-up rows need
the main model's hidden states of positions [num_head, n): the proposer keeps those device rows
per request (``keep_hidden`` after each commit) until the request drafts again. Chained rows take
the previous draft as their input id and the head's own ``hidden_states_out`` of the row before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mtpserve.engine import launches
from mtpserve.engine.kv_pool import KVPool
from mtpserve.engine.row_gather import stack_segments
from mtpserve.engine.runner import PackedRows, Runner
from mtpserve.engine.sampler import draw_tokens, probs, row_argmax, to_host

Array = Any   # numpy or cupy ndarray


class DeviceDrafts:
    """The drafts ``[B, K]`` of one step's requests, drafted with captured head forwards and
    still on the device: a captured verify step takes them from there (``Engine._verify``), and
    the one host copy for them all is made when something first reads a request's tokens (the
    accept, after the verify is queued), so no host round trip sits between drafting and
    verifying."""

    def __init__(self, array: Array):
        self.array = array
        self._host: np.ndarray | None = None

    def row(self, b: int, count: int) -> list[int]:
        if self._host is None:
            self._host = to_host(self.array)
        return self._host[b, :count].tolist()


class Drafts:
    """One request's drafts for this step, and the distributions they were sampled from.

    tokens: the draft ids (read from ``device`` row ``row`` on first use when they were made on
    the device); q: per draft, the [V] probabilities it was sampled from, or None (greedy)."""

    __slots__ = ("_tokens", "q", "device", "row")

    def __init__(self, tokens: list[int] | None, q: list, device: DeviceDrafts | None = None, row: int = 0):
        self._tokens, self.q, self.device, self.row = tokens, q, device, row

    @property
    def count(self) -> int:
        """How many drafts (one q entry each, None for greedy)."""
        return len(self.q)

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._tokens = self.device.row(self.row, self.count)
        return self._tokens


def _longest_past(requests: list, max_rows: int) -> list:
    """The requests whose catch-ups, done apart (each down to its last row), bring the rest of a
    drafting forward within ``max_rows`` rows: the longest first, no more than that needs."""
    rows = [(r.num_computed - r.num_head, r) for r in requests]
    total, chosen = sum(n for n, _ in rows), []
    if total <= max_rows:                          # every step but a long catch-up's: no sort
        return chosen
    for n, r in sorted(rows, key=lambda x: -x[0]):
        if total <= max_rows or n <= 1:
            break
        chosen.append(r)
        total -= n - 1
    return chosen


class MTPProposer:
    """Drafts with the MTP head; holds each request's pending main-model hidden rows."""

    def __init__(self, runner: Runner, head_pool: KVPool, xp, graphs=None, grammars=None,
                 max_rows: int | None = None):
        """graphs: cuda_graphs.HeadGraphs, to draft greedy steps with captured head forwards;
        grammars: the engine's ``grammar.GrammarManager``: a constrained request's drafts are
        drawn from its grammar's masked head logits (draft i after drafts 0..i-1), and its
        matcher is back at the committed output on return; max_rows: the most rows one head
        forward takes (the step's token budget, which also bounds the main model's): a longer
        catch-up (a new prompt past it) runs in pieces, so the head's logits buffer ([rows,
        vocab]) and the matrix products' row counts stay within what a step has."""
        self.runner, self.head_pool, self.xp, self.graphs = runner, head_pool, xp, graphs
        self.grammars, self.max_rows = grammars, max_rows
        # (array, start, count) segments: rows [start, start + count) of a step's [T, H] hidden
        # states, together covering positions [num_head, num_computed) of the request
        self._pending: dict[str, list[tuple[Array, int, int]]] = {}

    def keep_hidden(self, request_id: str, hidden: Array, start: int, count: int) -> None:
        """The main model's hidden states of a request's newly committed positions: rows
        ``hidden[start:start + count]`` (kept by reference, not copied)."""
        self.keep_step((request_id,), hidden, (start,), (count,))

    def keep_step(self, request_ids, hidden: Array, starts, counts) -> None:
        """``keep_hidden`` for each of a step's requests: request i's rows ``hidden[starts[i]:
        starts[i] + counts[i]]`` (one call a step: on every step of an MTP engine, drafting or not)."""
        pending = self._pending
        for rid, start, n in zip(request_ids, starts, counts):
            pending.setdefault(rid, []).append((hidden, start, n))

    def pending_rows(self, request_id: str, offset: int, count: int) -> Array:
        """A copy of pending hidden rows ``offset .. offset + count`` (0 = position num_head)."""
        return stack_segments(self._pending_segments(request_id, offset, count), self.xp)

    def _pending_segments(self, request_id: str, offset: int, count: int) -> list[tuple[Array, int, int]]:
        """Pending hidden rows ``offset .. offset + count`` as ``(array, start, count)`` segments
        of the arrays that hold them."""
        segments, at = [], 0
        for arr, start, n in self._pending.get(request_id, []):
            lo, hi = max(offset, at), min(offset + count, at + n)
            if lo < hi:
                segments.append((arr, start + lo - at, hi - lo))
            at += n
        if sum(n for _, _, n in segments) != count:
            raise AssertionError(f"{request_id}: pending hidden rows cover {at}, asked {offset}..{offset + count}")
        return segments

    def _stacked(self, segments: list[tuple[Array, int, int]]) -> Array:
        """The head's hidden input from ``segments``: the one segment's rows as they are (a view),
        or all of them stacked."""
        if len(segments) == 1:
            arr, start, count = segments[0]
            return arr[start:start + count]
        return stack_segments(segments, self.xp)

    def forget(self, request_id: str) -> None:
        """The request ended or was preempted: its pending rows are of no use any more."""
        self._pending.pop(request_id, None)

    @property
    def request_ids(self) -> set[str]:
        return set(self._pending)

    def propose(self, drafting: list, after=None) -> dict[str, Drafts]:
        """Drafts of every scheduled request with ``num_drafts > 0`` (``ScheduledRequest``s);
        their head rows up to num_computed are then in the head's KV (``num_head`` advances).

        ``after``: the launched draft step (``pipeline.LaunchedStep``) that every one of them was
        in, whose rows are committed on the device but not yet on the host: the head catches up
        on its kept rows from its hidden rows and emitted tokens (on the device when captured
        forwards fit; else from their host copy, a wait), and ``num_head`` advances when that
        step lands (the engine's ``_land``)."""
        if not drafting:
            return {}
        if after is not None:
            if not after.num_drafts:     # after a decode step: every row but its own first, from the host's ids
                self._catch_up_long([s.request for s in drafting])
            return self._propose_after(drafting, after)
        constrained = [s.request.request_id for s in drafting if self.grammars and s.request.request_id in self.grammars]
        graphed = self.graphs is not None and not constrained and all(s.request.params.is_greedy for s in drafting)
        requests = [s.request for s in drafting]
        if graphed:
            self._catch_up_long([r for r in requests if r.num_computed - r.num_head > self.graphs.catch_up_rows])
        elif self.max_rows is not None:                  # the drafting forward within max_rows
            self._catch_up_long(_longest_past(requests, self.max_rows))
        rows = [PackedRows(s.request.token_ids[s.request.num_head + 1:s.request.num_computed + 1],
                           s.request.num_head, self.head_pool.block_array(s.request.request_id)) for s in drafting]
        if graphed:
            tokens = self.graphs.draft(rows, [self._pending.get(s.request.request_id, []) for s in drafting],
                                       max(s.num_drafts for s in drafting))
            if tokens is not None:                 # [B, K] on the device: read when first needed
                for s in drafting:
                    self._pending.pop(s.request.request_id, None)
                    s.request.num_head = s.request.num_computed
                return self._device_result(drafting, tokens)
        hidden = [segment for s in drafting for segment in self._pending.pop(s.request.request_id, [])]
        for s in drafting:
            s.request.num_head = s.request.num_computed
        return self._draft_eager(drafting, rows, self._stacked(hidden), constrained)

    def _propose_after(self, drafting: list, after) -> dict[str, Drafts]:
        """``propose`` after the launched step ``after`` (see there): a draft step, or a decode
        step whose rows but the last the head has caught up on (its last row's id is the step's
        token, on the device; its first row then, as a draft step's with no drafts)."""
        k1 = after.num_drafts + 1
        tables = [self.head_pool.block_array(s.request.request_id) for s in drafting]
        starts = after.plan.layout.target_row     # (a draft step's fed row; a decode step's last)
        if self.graphs is not None:
            past = np.fromiter((s.request.num_head for s in drafting), np.int64, len(drafting))
            tokens = self.graphs.draft_after(past, tuple(tables), after.hidden, starts,
                                             max(s.num_drafts for s in drafting), (after.accepted(), k1))
            if tokens is not None:
                self._caught_up_on_decode(drafting, after)
                return self._device_result(drafting, tokens)
        launches.escape()            # (eager drafting: a deferred step's launches go first)
        accepted = after.host_accepted()
        rows, hidden = [], []
        for b, (s, t) in enumerate(zip(drafting, tables)):
            kept = int(accepted[b, k1])
            rows.append(PackedRows(accepted[b, :kept].tolist(), s.request.num_head, t))
            hidden.append((after.hidden, starts[b], kept))
        result = self._draft_eager(drafting, rows, self._stacked(hidden), [])
        self._caught_up_on_decode(drafting, after)
        return result

    def _caught_up_on_decode(self, drafting: list, after) -> None:
        """After a decode step ``after`` (committed at its launch) the head has every row now:
        its pending rows go. (After a draft step, ``num_head`` advances when that step lands.)"""
        if after.num_drafts:
            return
        for s in drafting:
            self._pending.pop(s.request.request_id, None)
            s.request.num_head = s.request.num_computed

    @staticmethod
    def _device_result(drafting: list, tokens) -> dict[str, Drafts]:
        shared = DeviceDrafts(tokens)
        return {s.request.request_id: Drafts(None, [None] * s.num_drafts, shared, b) for b, s in enumerate(drafting)}

    def _draft_eager(self, drafting: list, rows: list[PackedRows], hidden, constrained: list) -> dict[str, Drafts]:
        """Eager drafting: one head forward over each request's catch-up ``rows`` (its last row
        gives draft 0), then chained single-row forwards; request j's draft i sits at position
        ``rows[j].past_len + len(rows[j].token_ids) + i - 1``."""
        out = self.runner.run_head(rows, hidden)
        last = np.cumsum([len(p.token_ids) for p in rows]) - 1
        if last[-1] == len(rows) - 1:                  # one catch-up row each: all rows are last rows
            logits, head_hidden = out.logits, out.hidden
        else:
            last = self.xp.asarray(last)
            logits, head_hidden = out.logits[last], out.hidden[last]
        result: dict[str, Drafts] = {}
        after_rows = {}
        for s, r in zip(drafting, rows):
            result[s.request.request_id] = Drafts([], [])
            after_rows[s.request.request_id] = r.past_len + len(r.token_ids)
        active = drafting
        for i in range(max(s.num_drafts for s in drafting)):
            if i > 0:
                rows = [PackedRows([result[s.request.request_id].tokens[-1]], after_rows[s.request.request_id] + i - 1,
                                   self.head_pool.block_array(s.request.request_id)) for s in active]
                out = self.runner.run_head(rows, head_hidden)
                logits, head_hidden = out.logits, out.hidden
            tokens, q = self._draft_tokens(active, self._constrained(active, logits) if constrained else logits, i)
            for j, s in enumerate(active):
                d = result[s.request.request_id]
                d.tokens.append(int(tokens[j]))
                d.q.append(None if q is None or s.request.params.is_greedy or s.request.params.is_seeded_sampled
                           else q[j])
                if constrained and s.request.request_id in self.grammars:
                    self.grammars.speculate(s.request.request_id, int(tokens[j]))
            keep = [j for j, s in enumerate(active) if s.num_drafts > i + 1]
            if not keep:
                break
            if len(keep) < len(active):
                active = [active[j] for j in keep]
                rows_kept = self.xp.asarray(np.array(keep))
                logits, head_hidden = logits[rows_kept], head_hidden[rows_kept]
        for rid in constrained:
            self.grammars.rollback(rid)
        return result

    def catch_up(self, requests: list) -> None:
        """The head's KV of each request's rows from ``num_head`` to its last committed row (not
        included: its id is the token the last step samples), from its pending hidden rows;
        ``num_head`` advances (``_catch_up_long``)."""
        self._catch_up_long(requests)

    def _catch_up_long(self, long: list) -> None:
        """Requests with many head rows to catch up (a new prompt, a prefix hit, drafting resumed
        after a pause): all their rows but the last, in head forwards (their outputs unused: the
        rows only fill the head's KV), so this step's drafting still fits a captured shape, or
        the eager drafting forward the budget. Without it one such request made the whole batch
        draft eagerly, with a host round trip per draft level.

        With captured head forwards the rows go in pieces of at most the largest fill (round j:
        every request's piece j, in ``HeadGraphs.fill``'s padded forwards; a piece no captured
        shape fits runs eagerly after them). Eagerly, pieces of at most ``max_rows`` rows go into
        forwards in order, a forward closing when the next piece would not fit; only a request's
        last piece is shorter than ``max_rows``, so a forward never holds two pieces of one
        request (the second would not see the first's KV)::

            max_rows 4:  a: 9 rows, b: 2    pieces a0..3 | a4..7 | a8, b0..1
        """
        long = [r for r in long if r.num_computed - r.num_head > 1]
        if not long:
            return
        counts = [r.num_computed - r.num_head - 1 for r in long]      # every row but the last
        fills = self.graphs.fill_counts if self.graphs is not None else ()
        size = max(fills) if fills else self.max_rows or max(counts) + 1
        # per request, its pieces (request, offset, count)
        pieces = [[(r, at, min(size, m - at)) for at in range(0, m, size)] for r, m in zip(long, counts)]
        if fills:
            for j in range(max(len(p) for p in pieces)):
                round_j = [p[j] for p in pieces if j < len(p)]
                left = self.graphs.fill(self._piece_rows(round_j), [self._pending_segments(r.request_id, at, n)
                                                                    for r, at, n in round_j])
                self._eager_catch_up([round_j[i] for i in left], size)
        else:
            self._eager_catch_up([x for p in pieces for x in p], size)
        for r, m in zip(long, counts):
            self._drop_pending(r.request_id, m)
            r.num_head += m

    def _piece_rows(self, pieces: list) -> list[PackedRows]:
        """The head rows of catch-up pieces ``(request, offset, count)`` (offset from num_head)."""
        return [PackedRows(r.token_ids[r.num_head + 1 + at:r.num_head + 1 + at + n], r.num_head + at,
                           self.head_pool.block_array(r.request_id)) for r, at, n in pieces]

    def _eager_catch_up(self, pieces: list, size: int) -> None:
        """Eager head forwards over catch-up ``pieces`` (in order, at most ``size`` rows a forward)."""
        if not pieces:
            return
        forwards, rows_in = [[]], 0
        for piece in pieces:
            if rows_in + piece[2] > size:
                forwards.append([])
                rows_in = 0
            forwards[-1].append(piece)
            rows_in += piece[2]
        for forward in forwards:
            # every piece's pending rows stacked at once: after a pause, a gather a step's hidden
            # array (the pieces share them) where a copy a segment cost ~10 launches a step
            segments = [x for r, at, n in forward for x in self._pending_segments(r.request_id, at, n)]
            self.runner.run_head(self._piece_rows(forward), self._stacked(segments))

    def _drop_pending(self, request_id: str, count: int) -> None:
        """Forget the first ``count`` pending hidden rows of a request (their head rows are in)."""
        kept, left = [], count
        for arr, start, n in self._pending.get(request_id, []):
            if left >= n:
                left -= n
                continue
            kept.append((arr, start + left, n - left))
            left = 0
        self._pending[request_id] = kept

    def _constrained(self, active: list, logits):
        """A copy of the head's logits with each constrained request's row masked by its grammar."""
        rows = [j for j, s in enumerate(active) if s.request.request_id in self.grammars]
        if not rows:
            return logits
        bitmask = self.grammars.bitmask(len(rows))
        for i, j in enumerate(rows):
            self.grammars.fill_mask(active[j].request.request_id, bitmask, i)
        out = logits.copy()
        self.grammars.mask_rows(out, rows, bitmask, self.xp)
        return out

    def _draft_tokens(self, active: list, logits, index: int):
        """Draft ``index`` of each active request: the argmax when all are greedy, else drawn from
        the head's processed distribution q (``sampler.draw_tokens`` at that output position:
        a seeded request's with the noise its target row will draw with); q is returned for
        rejection sampling."""
        params = [s.request.params for s in active]
        if all(p.is_greedy for p in params):
            return to_host(row_argmax(logits, self.xp)), None
        q = probs(logits, params, self.xp)       # a greedy row's q is one-hot: any draw is its argmax
        return draw_tokens(q, [s.request for s in active], [index] * len(active), self.xp), q
