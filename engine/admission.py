"""Admission: one check of what a request may ask, and the worst-case ledger that queues it.

Every entry point validates a request with ``check_request`` against the replica's
``RequestLimits`` (the engine's ``add_request``, the worker's engine loop before queueing it):
one set of rules, one set of messages (a ValueError is an HTTP 400).

Worst case of one request (P prompt tokens, M = max_tokens, C = context length, B = block size):

    main KV slots reserved by any step  <= min(P + M, C)       (drafts are capped by the output
    KV blocks                           =  cdiv(min(P + M, C), B)   budget and the context left)
    MTP head KV                         <= main KV             (same block count per pool)
    state rows                          =  1

A request can never run when that exceeds the KV capacity, ``(usable blocks - 1) * B`` tokens:
the engine keeps one block of slack so a full-length request still leaves the scheduler room
to move.

The engine's scheduler reserves KV step by step and preempts (recomputes) the newest request
when a pool runs dry. On a Serve replica the engine loop applies a stricter policy in front of
it, ``ReservationLedger``: each request is charged its worst-case footprint up front, against
the grant the planner actor gave the replica, and waits in a FIFO queue until that fits. A burst
therefore queues; nobody fails and nobody is preempted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtpserve.engine.kv_pool import cdiv


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can serve: the sequence length, the KV capacity and the vocabulary."""
    context_length: int          # the longest prompt + output (max_model_len when set)
    block_size: int
    num_usable_blocks: int       # per paged pool
    vocab_size: int

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens one request may hold (one block is kept as slack)."""
        return (self.num_usable_blocks - 1) * self.block_size

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + output a request can reach here."""
        return min(self.context_length, self.kv_capacity_tokens)


@dataclass(frozen=True)
class Footprint:
    """What one request may hold at most: KV blocks (per paged pool) and state rows."""
    num_blocks: int
    num_rows: int = 1


def check_token_ids(params, vocab_size: int) -> None:
    """The token ids a request's parameters name (``stop_token_ids``, ``logit_bias``'s keys) are
    in the vocabulary: ValueError naming the field otherwise (out of range, a step's mask or bias
    would index past the logits and fail every request of the replica)."""
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t, _ in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")


def check_request(token_ids: Sequence[int] | int, max_tokens: int, limits: RequestLimits,
                  params=None) -> Footprint:
    """Validate a request (its prompt ids, or only their count, and its ``SamplingParams`` when
    given: ``check_token_ids``) and return its worst-case footprint; ValueError, with a message
    for the client, when it can never run here."""
    if params is not None:
        check_token_ids(params, limits.vocab_size)
    num_prompt_tokens = token_ids if isinstance(token_ids, int) else len(token_ids)
    if num_prompt_tokens < 1:
        raise ValueError("the prompt is empty")
    if not isinstance(token_ids, int) and any(not 0 <= t < limits.vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be in [0, {limits.vocab_size})")
    context = limits.context_length
    if num_prompt_tokens >= context:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens; the longest sequence served (the "
                         f"context) is {context} tokens, and a new token must fit too")
    num_tokens = min(num_prompt_tokens + max_tokens, context)
    if num_tokens > limits.kv_capacity_tokens:
        raise ValueError(f"prompt + max_tokens = {num_tokens} tokens exceeds a replica's KV cache "
                         f"({limits.kv_capacity_tokens} tokens); lower max_tokens")
    return Footprint(cdiv(num_tokens, limits.block_size))


class ReservationLedger:
    """Worst-case reservations of the requests admitted to one engine, within a grant.

    ``can_reserve`` / ``reserve`` / ``release``; the grant may shrink below what is held (the
    planner drains a replica): nothing is revoked, new requests just wait.
    """

    def __init__(self, num_blocks_granted: int, num_rows_granted: int):
        self.num_blocks_granted = num_blocks_granted
        self.num_rows_granted = num_rows_granted
        self._held: dict[str, Footprint] = {}
        self.num_reserved_blocks = 0
        self.num_reserved_rows = 0
        self.peak_reserved_blocks = 0
        self.peak_reserved_rows = 0

    @property
    def request_ids(self) -> list[str]:
        return list(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def set_grant(self, num_blocks: int, num_rows: int) -> None:
        self.num_blocks_granted, self.num_rows_granted = num_blocks, num_rows

    def fits_grant(self, footprint: Footprint) -> bool:
        """Whether the request could ever be admitted under the current grant."""
        return footprint.num_blocks <= self.num_blocks_granted and footprint.num_rows <= self.num_rows_granted

    def can_reserve(self, footprint: Footprint) -> bool:
        return (self.num_reserved_blocks + footprint.num_blocks <= self.num_blocks_granted
                and self.num_reserved_rows + footprint.num_rows <= self.num_rows_granted)

    def reserve(self, request_id: str, footprint: Footprint) -> bool:
        """Charge the footprint; False (and no change) when it does not fit."""
        assert request_id not in self._held, f"{request_id!r} is already admitted"
        if not self.can_reserve(footprint):
            return False
        self._held[request_id] = footprint
        self.num_reserved_blocks += footprint.num_blocks
        self.num_reserved_rows += footprint.num_rows
        self.peak_reserved_blocks = max(self.peak_reserved_blocks, self.num_reserved_blocks)
        self.peak_reserved_rows = max(self.peak_reserved_rows, self.num_reserved_rows)
        return True

    def release(self, request_id: str) -> bool:
        """Return a request's reservation; False if it held none."""
        footprint = self._held.pop(request_id, None)
        if footprint is None:
            return False
        self.num_reserved_blocks -= footprint.num_blocks
        self.num_reserved_rows -= footprint.num_rows
        return True

    def check_integrity(self) -> None:
        """Totals equal the sum of the held footprints; all counts are non-negative."""
        blocks = sum(f.num_blocks for f in self._held.values())
        rows = sum(f.num_rows for f in self._held.values())
        assert (blocks, rows) == (self.num_reserved_blocks, self.num_reserved_rows), (
            f"ledger totals ({self.num_reserved_blocks}, {self.num_reserved_rows}) != held ({blocks}, {rows})")
        assert blocks >= 0 and rows >= 0, "negative reservation"
