"""Admission on one worker: a request enters the engine only when its worst case fits the grant.

The engine's own step planner reserves KV blocks step by step and preempts (recomputes) the
newest request when a pool runs dry. The worker avoids ever getting there: each request is
charged its worst-case footprint up front, against the grant the planner actor gave this
replica, and waits in a FIFO queue until that fits. A burst therefore queues; nobody fails and
nobody is preempted.

Worst case of one request (P prompt tokens, M = max_tokens, C = context length, B = block size):

    main KV slots reserved by any step  <= min(P + M, C)       (drafts are capped by the output
    KV blocks                           =  cdiv(min(P + M, C), B)   budget and the context left)
    MTP head KV                         <= main KV             (same block count per pool)
    state rows                          =  1
"""

from __future__ import annotations

from dataclasses import dataclass

from mtpserve.engine.kv_pool import cdiv


@dataclass(frozen=True)
class Footprint:
    """What one request may hold at most: KV blocks (per paged pool) and state rows."""
    num_blocks: int
    num_rows: int = 1


def request_footprint(num_prompt_tokens: int, max_tokens: int, context_length: int,
                      block_size: int, num_usable_blocks: int) -> Footprint:
    """The worst-case footprint of a request; ValueError (an HTTP 400) when it can never fit."""
    if num_prompt_tokens < 1:
        raise ValueError("the prompt is empty")
    if num_prompt_tokens >= context_length:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens; the longest sequence served (the "
                         f"context) is {context_length} tokens, and a new token must fit too")
    num_tokens = min(num_prompt_tokens + max_tokens, context_length)
    capacity = (num_usable_blocks - 1) * block_size      # the engine keeps one block of slack
    if num_tokens > capacity:
        raise ValueError(f"prompt + max_tokens = {num_tokens} tokens exceeds a replica's KV cache "
                         f"({capacity} tokens); lower max_tokens")
    return Footprint(cdiv(num_tokens, block_size))


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
