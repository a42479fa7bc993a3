"""Paged KV block pool: which block ids each request holds, and how many of its tokens count.

One instance per paged cache (the main model's and the MTP head's, same block count). It hands
out block ids only; the engine owns the ``[num_blocks, block_size, Hkv, D]`` arrays.

Every usable block is in exactly one of three states, derived from the per-request tables:

- **free**: in the free queue;
- **committed**: in a request's table and holding at least one committed token
  (the first ``cdiv(committed_len, block_size)`` entries of its table);
- **reserved**: in a request's table past its committed blocks (lookahead for this step's
  prefill chunk, decode token and drafts).

A step does ``reserve(rid, committed_len + num_fed)`` (all-or-nothing, ``False`` = no room, the
planner decides), runs, then ``commit(rid, committed_len + num_kept)``. Blocks that were reserved
for a rejected draft suffix **stay reserved to the request**: the next step's lookahead almost
always needs them again, so keeping them saves a free/re-reserve round trip. ``trim(rid)`` hands
them back when the planner needs room (before preempting someone). ``free(rid)`` returns all of a
request's blocks at once (finish, cancel, preempt).

The first ``num_scratch_blocks`` block ids (default 1: block 0) are never handed out. The CPU
adapter points writes that must be skipped at the scratch block, since a ``-1`` slot cannot be
expressed in its ScatterND; padding entries of a block table may point there too.

**Sharing** (the prefix cache, ``engine/prefix_cache.py``). A full committed block can be marked
*cached* (``mark_cached``): its contents are then a function of the tokens before it, and a new
request may start its table with cached blocks (``attach``) instead of computing them. Each block
counts the tables holding it; a cached block no table holds is *evictable*: it counts as free
space and is reclaimed, least recently released first, when the free queue runs dry (``on_evict``
tells the cache to forget it). A request only ever writes at positions >= its committed length,
so a shared block (always a full block before that) is never written::

    free queue      | 7 9 12 ..          never cached, in no table
    in tables       | 3 (refs 2) 4 (refs 1) ...    refs = the tables holding it
    evictable (LRU) | 5 11 ..            cached, in no table: reclaimed oldest first
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVPool:
    """Block-id manager for one paged KV cache (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, num_scratch_blocks: int = 1):
        if block_size <= 0 or num_scratch_blocks < 0 or num_blocks <= num_scratch_blocks:
            raise ValueError(f"bad pool shape: num_blocks={num_blocks} block_size={block_size} "
                             f"num_scratch_blocks={num_scratch_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_scratch_blocks = num_scratch_blocks
        self._free: deque[int] = deque(range(num_scratch_blocks, num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._arrays: dict[str, np.ndarray] = {}            # block_array's copies, dropped when a table changes
        self._committed: dict[str, int] = {}
        self._refs: dict[int, int] = {}                     # block -> tables holding it (> 0)
        self._cached: set[int] = set()                      # blocks whose contents the prefix cache keeps
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached, in no table; oldest first
        self.on_evict: Callable[[int], None] | None = None   # told when an evictable block is reclaimed

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (total minus scratch)."""
        return self.num_blocks - self.num_scratch_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a reservation can take: the free queue and the evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_reserved_blocks(self) -> int:
        """Table entries past each request's committed blocks (never shared)."""
        return sum(len(t) - cdiv(self._committed[r], self.block_size) for r, t in self._tables.items())

    @property
    def num_committed_blocks(self) -> int:
        """Distinct blocks holding committed tokens (a shared block counts once)."""
        return len(self._refs) - self.num_reserved_blocks

    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    # ---- reservation --------------------------------------------------------------------
    def num_blocks_needed(self, request_id: str, num_tokens_total: int) -> int:
        """Blocks ``reserve(request_id, num_tokens_total)`` would take from the free queue."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens_total, self.block_size) - have)

    def can_reserve(self, request_id: str, num_tokens_total: int) -> bool:
        return self.num_blocks_needed(request_id, num_tokens_total) <= self.num_free_blocks

    def reserve(self, request_id: str, num_tokens_total: int) -> bool:
        """Make the request's table cover token slots ``[0, num_tokens_total)``.

        All or nothing: returns False and changes nothing when the free blocks are not there.
        Registers an unknown request. Never shrinks a table (see ``trim``). To reserve for
        several requests atomically, sum ``num_blocks_needed`` and compare with
        ``num_free_blocks`` first.
        """
        if num_tokens_total < 0:
            raise ValueError(f"num_tokens_total must be >= 0, got {num_tokens_total}")
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens_total:
            return True                           # (most steps: the table already covers it)
        need = self.num_blocks_needed(request_id, num_tokens_total)
        if need > self.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        self._committed.setdefault(request_id, 0)
        for _ in range(need):
            block = self._take()
            self._refs[block] = 1
            table.append(block)
        if need:                                  # (after the loop: an eviction callback sees the old copy)
            self._arrays.pop(request_id, None)
        return True

    def _take(self) -> int:
        """A block for a reservation: from the free queue, else the oldest evictable one."""
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        self._cached.discard(block)
        if self.on_evict is not None:
            self.on_evict(block)
        return block

    def _release(self, block: int) -> None:
        """One table let go of ``block``."""
        refs = self._refs[block] - 1
        if refs:
            self._refs[block] = refs
            return
        del self._refs[block]
        if block in self._cached:
            self._evictable[block] = None
        else:
            self._free.append(block)

    # ---- sharing ------------------------------------------------------------------------
    def attach(self, request_id: str, blocks: Sequence[int]) -> None:
        """Start a new request's table with cached blocks, all committed (a prefix-cache hit)."""
        if request_id in self._tables:
            raise AssertionError(f"attach({request_id!r}): the request already holds blocks")
        for b in blocks:
            if b not in self._cached:
                raise AssertionError(f"attach({request_id!r}): block {b} is not cached")
        for b in blocks:
            self._evictable.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1
        self._tables[request_id] = list(blocks)
        self._arrays.pop(request_id, None)
        self._committed[request_id] = len(blocks) * self.block_size

    def mark_cached(self, block: int) -> None:
        """The prefix cache keeps this (full, committed) block's contents."""
        if block not in self._refs:
            raise AssertionError(f"mark_cached({block}): the block is in no table")
        self._cached.add(block)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def uncache(self, block: int) -> None:
        """The prefix cache forgets the block: free once no table holds it."""
        if block not in self._cached:
            return
        self._cached.discard(block)
        if self._evictable.pop(block, 0) is None:
            self._free.append(block)

    def commit(self, request_id: str, committed_len: int) -> None:
        """Set the request's committed token count (monotone, within its reserved slots)."""
        self._require(request_id)
        old, cap = self._committed[request_id], len(self._tables[request_id]) * self.block_size
        if not old <= committed_len <= cap:
            raise AssertionError(f"commit({request_id!r}, {committed_len}): must lie in "
                                 f"[committed {old}, reserved slots {cap}]")
        self._committed[request_id] = committed_len

    def trim(self, request_id: str) -> int:
        """Return the request's reserved blocks past its committed length; the number freed."""
        self._require(request_id)
        table = self._tables[request_id]
        keep = cdiv(self._committed[request_id], self.block_size)
        extra = table[keep:]
        if extra:
            self._arrays.pop(request_id, None)
        del table[keep:]
        for b in extra:
            self._release(b)
        return len(extra)

    def free(self, request_id: str) -> int:
        """Return all the request's blocks and forget it; the number freed (0 if unknown)."""
        table = self._tables.pop(request_id, None)
        self._arrays.pop(request_id, None)
        if table is None:
            return 0
        del self._committed[request_id]
        for b in table:
            self._release(b)
        return len(table)

    # ---- lookups ------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        self._require(request_id)
        return list(self._tables[request_id])

    def block_array(self, request_id: str) -> np.ndarray:
        """``block_table`` as a read-only int32 array, made when the table last changed (a new
        block every ``block_size`` tokens) and shared until it changes again: what a step's rows
        carry into its inputs. (A list copied and converted per request and step took 55 us a
        step at 16 requests of 113 blocks on a 2-core host, these arrays 10.)"""
        arr = self._arrays.get(request_id)
        if arr is None:
            self._require(request_id)
            arr = self._arrays[request_id] = np.array(self._tables[request_id], np.int32)
            arr.flags.writeable = False
        return arr

    def committed_len(self, request_id: str) -> int:
        self._require(request_id)
        return self._committed[request_id]

    def slot(self, request_id: str, position: int) -> int:
        """Flat slot of a token position in the pool viewed as ``[num_blocks * block_size, ...]``.

        ::

            block_size = 4, block_table = [7, 2, 9]

            position p      0 1 2 3 | 4 5 6 7 | 8 9 10 11
            p // bs         0       | 1       | 2            index into block_table
            block id        7       | 2       | 9
            p % bs          0 1 2 3 | 0 1 2 3 | 0 1 2  3     offset inside the block
            slot = block_table[p // bs] * bs + p % bs    e.g. p=5 -> 2*4+1 = 9, p=10 -> 9*4+2 = 38
        """
        table, bs = self._tables[request_id], self.block_size
        if not 0 <= position < len(table) * bs:
            raise AssertionError(f"slot({request_id!r}, {position}): outside reserved slots "
                                 f"[0, {len(table) * bs})")
        return table[position // bs] * bs + position % bs

    def slots(self, request_id: str, start: int, stop: int) -> np.ndarray:
        """``slot`` for positions ``[start, stop)``, as int64 (the packed rows of one request)."""
        table, bs = self._tables[request_id], self.block_size
        if not 0 <= start <= stop <= len(table) * bs:
            raise AssertionError(f"slots({request_id!r}, {start}, {stop}): outside reserved "
                                 f"slots [0, {len(table) * bs})")
        pos = np.arange(start, stop, dtype=np.int64)
        return np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs

    # ---- checks -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every usable block is exactly one of free, evictable or in
        tables (with its reference count equal to the tables holding it), a block held by two
        tables is a cached committed block, every id is a usable id, and each committed length
        fits its table."""
        owners: dict[int, str] = {b: "<free>" for b in self._free}
        if len(owners) != len(self._free):
            raise AssertionError("free queue holds a block twice")
        for b in self._evictable:
            if b in owners or b not in self._cached or b in self._refs:
                raise AssertionError(f"evictable block {b} is also free, uncached or in a table")
            owners[b] = "<evictable>"
        counts: dict[int, int] = {}
        for rid, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"{rid!r} holds a block twice")
            committed_blocks = cdiv(self._committed.get(rid, 0), self.block_size)
            for i, b in enumerate(table):
                if b in owners and owners[b] in ("<free>", "<evictable>"):
                    raise AssertionError(f"block {b} owned by {rid!r} and {owners[b]!r}")
                if b in owners and (b not in self._cached or i >= committed_blocks):
                    raise AssertionError(f"block {b} owned by {rid!r} and {owners[b]!r} but not a cached committed block")
                owners[b] = rid
                counts[b] = counts.get(b, 0) + 1
            n = self._committed.get(rid)
            if n is None or not 0 <= n <= len(table) * self.block_size:
                raise AssertionError(f"{rid!r}: committed_len {n} does not fit its "
                                     f"{len(table)} blocks of {self.block_size}")
        if set(self._committed) != set(self._tables):
            raise AssertionError("committed lengths and block tables name different requests")
        for rid, arr in self._arrays.items():
            if rid not in self._tables or arr.tolist() != self._tables[rid]:
                raise AssertionError(f"{rid!r}: block_array's copy differs from the block table")
        if counts != self._refs:
            raise AssertionError("block reference counts differ from the tables holding them")
        if not self._cached <= set(self._refs) | set(self._evictable):
            raise AssertionError("a cached block is free")
        if set(owners) != set(range(self.num_scratch_blocks, self.num_blocks)):
            raise AssertionError(f"{len(owners)} blocks accounted for (free "
                                 f"{self.num_free_blocks} + reserved {self.num_reserved_blocks} + "
                                 f"committed {self.num_committed_blocks}), pool has "
                                 f"{self.num_usable_blocks} usable ids")

    def _require(self, request_id: str) -> None:
        if request_id not in self._tables:
            raise AssertionError(f"unknown request {request_id!r} in the KV pool")
