"""Prefix cache for hybrid models: shared full KV blocks plus fixed-state snapshots, exact with MTP.

A request's tokens are cut into full blocks; block k's digest chains the digest of block k-1
with block k's token ids, so a digest names the whole prefix up to the block's end. An entry
per digest keeps what a later request with the same prefix can reuse instead of computing it:

    entry k (prefix of (k+1)*bs tokens)
      block        the main model's KV block of positions [k*bs, (k+1)*bs)
      head_block   the MTP head's KV block of positions [(k-1)*bs, k*bs): a head row at position
                   p pairs hidden[p] with token p+1, so the head's block k-1 is fixed only once
                   block k's first token is known (entry k's prefix contains it)
      snapshot     (some entries) a state-bank slot: every conv and recurrent row after the prefix
      hidden       (with a snapshot, MTP on) the main model's hidden rows of block k's positions

Recurrent state cannot be rebuilt from KV: a request may only start from an entry that has a
snapshot. A hit of b blocks (the deepest snapshot entry on the request's chain, leaving at least
one prompt token to feed) therefore gives it main blocks 0..b-1, its state from the snapshot,
and head blocks 0..b-2; the head catches up on block b-1 from the entry's hidden rows, exactly as
it would have after computing the prefix itself::

    positions      | block 0 | block 1 | ... | block b-1 | b*bs .. prompt end
    main KV        | shared  | shared  | ... | shared    | computed
    state          '-------------- snapshot of entry b-1 --'-> computed
    head KV        | shared  | shared  | ... | caught up from entry b-1's hidden rows

Snapshots are taken where the scheduler ends a prompt chunk on purpose (``next_boundary``): where
the request's lookup stopped matching (the end of the prefix it shares with an earlier prompt: a
system prompt seen twice gets a snapshot at its end, so the third request starts there), and every
``snapshot_interval`` tokens and at the prompt's last full block before its final token: all of
them (``snapshot_all``, and a session's requests: ``expect_continuation``), or none of them
(``_plan_snapshots``, the default ``reused`` policy: a repeat snapshots where its match ends and
hits the third time). A chunk that ends on a boundary is a step of its own: with fresh 128-token
prompts on a 2-core CPU, snapshotting every boundary cost 0.86x the tokens/s and 2.5x the TTFT at
concurrency 8, where ``reused`` ran at the cache-off figures.
Entries whose blocks no request holds are evicted least recently used by the KV pools
(``on_evict``); snapshots have their own slots in the state bank, reclaimed least recently used.
Head blocks that a hit could not share (the creator never drafted over them) are given fresh
blocks and marked stale on the request: drafts may then be worse, the output is unchanged.

**Host tier** (``HostTier``): what the device lets go of need not be lost. An entry whose main
block is reclaimed, or whose snapshot loses its slot, is copied to host memory first if a later
lookup has met it again (``reused``; every entry with ``offload_all``): each copy is a synchronous
device-to-host transfer per array on the step path, and offloading every one-off prompt cost a
1.4 B model 10x its TTFT at C=64 on the H200 (packing on the step path as well had cost ~90 ms
per 37 MiB snapshot). A later lookup whose chain runs into host records restores what it uses (the path's
blocks and one snapshot) before the hit. A record leaves the process serialised with msgpack
(``pack_record``: each array as raw bytes with its dtype and shape), the format that moves a
cached prefix between processes.

**Routing index** (``routing_index``): routers across replicas prefer the replica that holds a
request's longest prefix (``actors/router.py``). The cache keeps, in the order they were last
used, the digests of its entries within the first ``ROUTED_PREFIX_TOKENS`` tokens of a prompt,
and hands out the newest ones truncated to ``ROUTING_DIGEST_BYTES``: a compact set in which a
router looks up the same chain digests of a new prompt's first blocks (a digest names its whole
prefix, so the deepest one found is the longest cached prefix).
"""
from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from mtpserve.engine.kv_pool import KVPool
from mtpserve.engine.state_bank import StateBank

Array = Any

ROUTED_PREFIX_TOKENS = 1024      # how deep routing looks into a prompt (indexed here, hashed by routers)
ROUTING_DIGEST_BYTES = 8         # a routing index entry: the chain digest's first bytes


@dataclass
class CacheEntry:
    digest: bytes
    num_tokens: int                  # the prefix this entry ends: (k + 1) * block_size
    block: int
    head_block: int | None = None
    snapshot: int | None = None
    hidden: Array | None = None
    last_used: int = 0
    reused: bool = False             # a later lookup's chain ran through it: worth a host copy


@dataclass
class PrefixHit:
    """What a new request starts from (see the module docstring)."""
    num_tokens: int
    blocks: list[int]
    head_blocks: list[int]           # leading shareable head blocks (at most num_tokens / bs - 1)
    snapshot: int
    hidden: Array | None


@dataclass
class PrefixCacheStats:
    """vLLM-named counters: prefix_cache_queries / prefix_cache_hits are in tokens."""
    queries: int = 0
    hits: int = 0
    num_requests_hit: int = 0
    num_snapshots_taken: int = 0
    num_evicted_entries: int = 0
    num_offloaded: int = 0           # records written to the host tier
    num_restored: int = 0            # records brought back from it


def pack_array(arr) -> bytes:
    """One array as msgpack: {dtype, shape, data (raw bytes, C order)}; device arrays are copied out."""
    host = np.ascontiguousarray(_to_host(arr))
    return msgpack.packb({"dtype": host.dtype.str, "shape": list(host.shape), "data": host.tobytes()})


def unpack_array(blob: bytes, xp=np):
    d = msgpack.unpackb(blob)
    return xp.asarray(np.frombuffer(d["data"], np.dtype(d["dtype"])).reshape(d["shape"]))


def _to_host(arr) -> np.ndarray:
    """A host copy (never a view: the device array's slot is about to be reused)."""
    return arr.get() if hasattr(arr, "get") else np.array(arr, copy=True)


def pack_record(record: dict) -> bytes:
    """A host record as msgpack bytes (for another process): every array through ``pack_array``."""
    out = {}
    for name, part in record.items():
        if name in ("kv", "head"):
            out[name] = [pack_array(a) for a in part]
        elif name == "snapshot":
            out[name] = [pack_array(part[0]), pack_array(part[1]), part[2]]
        else:
            out[name] = pack_array(part)
    return msgpack.packb(out)


def unpack_record(blob: bytes) -> dict:
    """The inverse of ``pack_record``: host arrays again."""
    out = {}
    for name, part in msgpack.unpackb(blob).items():
        if name in ("kv", "head"):
            out[name] = [unpack_array(b) for b in part]
        elif name == "snapshot":
            out[name] = (unpack_array(part[0]), unpack_array(part[1]), part[2])
        else:
            out[name] = unpack_array(part)
    return out


def _part_bytes(part) -> int:
    if isinstance(part, np.ndarray):
        return part.nbytes
    return sum(_part_bytes(p) for p in part if not isinstance(p, int))


class HostTier:
    """Evicted entries' parts in host memory, by digest, least recently stored dropped first.

    A record is a dict of parts, host arrays: ``kv`` (the main block's K/V of every layer, a
    list), ``head`` (the head block's), ``snapshot`` ((conv, recurrent, length)) and ``hidden``."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._records: OrderedDict[bytes, dict] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._records

    def __len__(self) -> int:
        return len(self._records)

    def get(self, digest: bytes) -> dict | None:
        return self._records.get(digest)

    def put(self, digest: bytes, parts: dict) -> None:
        """Store (or add to) a record; the oldest records go when the budget is exceeded."""
        record = self._records.pop(digest, {})
        self.nbytes -= _record_bytes(record)
        record.update(parts)
        size = _record_bytes(record)
        if size > self.budget_bytes:
            return
        self._records[digest] = record
        self.nbytes += size
        while self.nbytes > self.budget_bytes:
            _, old = self._records.popitem(last=False)
            self.nbytes -= _record_bytes(old)

    def drop(self, digest: bytes, part: str | None = None) -> None:
        record = self._records.get(digest)
        if record is None:
            return
        if part is None:
            del self._records[digest]
            self.nbytes -= _record_bytes(record)
        elif part in record:
            self.nbytes -= _part_bytes(record.pop(part))
            if not record:
                del self._records[digest]


def _record_bytes(record: dict) -> int:
    return sum(_part_bytes(p) for p in record.values())


def chain_digests(tokens, block_size: int, digests: list[bytes]) -> list[bytes]:
    """Extend ``digests`` (of the first len(digests) blocks) over every full block of ``tokens``."""
    for k in range(len(digests), len(tokens) // block_size):
        h = hashlib.blake2b(digests[-1] if digests else b"", digest_size=16)
        h.update(np.asarray(tokens[k * block_size:(k + 1) * block_size], np.int64).tobytes())
        digests.append(h.digest())
    return digests


_PIN = "<prefix-cache restore>"       # the pool table that holds a lookup's path while it restores


@dataclass
class _RequestChain:
    """The cache's host bookkeeping of one live request."""
    digests: list[bytes] = field(default_factory=list)
    num_registered: int = 0          # main blocks 0.. of this request already looked at
    matched: int = 0                 # tokens its lookup matched (a snapshot is due there: the end of a shared prefix)
    num_head_registered: int = 0     # head blocks 0.. of this request considered for registration
    stale_head: range = range(0)     # head block indices holding stale contents (never registered)
    snapshot_at: tuple[int, ...] | None = None   # its prompt boundaries to snapshot (decided at lookup)
    every_boundary: bool = False     # a later request continues it (a session): snapshot as snapshot_all does


class PrefixCache:
    """The digest index and its policy; the pools hold the blocks, the bank the snapshots."""

    def __init__(self, block_size: int, kv_pool: KVPool, head_pool: KVPool | None, bank: StateBank,
                 snapshot_interval: int, xp=np, kv_arrays: Sequence = (), head_arrays: Sequence = (),
                 host_tier_bytes: int = 0, offload_all: bool = False, snapshot_all: bool = False,
                 hidden_row: tuple[int, object] | None = None):
        """kv_arrays / head_arrays: the pools' ``[num_blocks, block_size, ...]`` arrays, whose
        blocks the host tier copies out and back; host_tier_bytes: its budget (0 = no tier);
        offload_all: the tier takes every evicted entry, not only those a lookup met again;
        snapshot_all: snapshot every boundary of every prompt, not only where a match ends;
        hidden_row: (width, dtype) of the main model's hidden rows a snapshot keeps for the
        head (MTP on; None: no head), what an imported record's must be."""
        if snapshot_interval <= 0 or snapshot_interval % block_size:
            raise ValueError(f"snapshot_interval must be a positive multiple of the block size {block_size}, "
                             f"got {snapshot_interval}")
        self.block_size, self.kv_pool, self.head_pool, self.bank = block_size, kv_pool, head_pool, bank
        self.snapshot_interval, self.xp = snapshot_interval, xp
        self.entries: dict[bytes, CacheEntry] = {}
        self._by_block: dict[int, bytes] = {}
        self._by_head_block: dict[int, bytes] = {}
        self._chains: dict[str, _RequestChain] = {}
        self._routable: dict[bytes, None] = {}     # digests within ROUTED_PREFIX_TOKENS, least recently used first
        self.routing_version = 0                   # bumped whenever _routable gains or loses a digest
        self._clock = 0
        self.stats = PrefixCacheStats()
        self.kv_arrays, self.head_arrays = list(kv_arrays), list(head_arrays)
        self.host = HostTier(host_tier_bytes) if host_tier_bytes and self.kv_arrays else None
        self.offload_all = offload_all
        self.snapshot_all = snapshot_all
        self.hidden_row = None if hidden_row is None else (int(hidden_row[0]), np.dtype(hidden_row[1]))
        kv_pool.on_evict = self._block_evicted
        if head_pool is not None:
            head_pool.on_evict = self._head_block_evicted

    @property
    def num_snapshots(self) -> int:
        return sum(e.snapshot is not None for e in self.entries.values())

    # ------------------------------------------------------------------ lookups
    def prompt_boundary(self, num_prompt_tokens: int) -> int:
        """The last full-block boundary that leaves a prompt token to feed (0: none)."""
        return (num_prompt_tokens - 1) // self.block_size * self.block_size

    def next_boundary(self, request_id: str, num_prompt_tokens: int, num_computed: int) -> int | None:
        """Where a prompt chunk starting at ``num_computed`` must end so a snapshot can be taken:
        the next multiple of the interval, the prompt's last full block, or the end of the prefix
        the request's lookup matched beyond its hit (where the prompts that share it diverge)."""
        last = self.prompt_boundary(num_prompt_tokens)
        if num_computed >= last:
            return None
        plan = self._planned(self._chains.setdefault(request_id, _RequestChain()), num_prompt_tokens)
        return next((b for b in plan if b > num_computed), None)

    def _planned(self, chain: _RequestChain, num_prompt_tokens: int) -> tuple[int, ...]:
        """The request's snapshot plan: made at its first lookup, or here for one never looked up
        (a prompt that needs every row's logits: nothing matched)."""
        if chain.snapshot_at is None:
            chain.snapshot_at = self._plan_snapshots(chain, num_prompt_tokens)
        return chain.snapshot_at

    def _plan_snapshots(self, chain: _RequestChain, num_prompt_tokens: int) -> tuple[int, ...]:
        """The prompt boundaries worth a snapshot (each costs a chunk that ends there, a step of
        its own): the end of the prefix the lookup matched (shared with an earlier prompt: proven
        reuse), and with ``snapshot_all`` (or for a request that ``expect_continuation`` marked)
        every interval and the last-block boundary too. Without it a prompt seen once costs
        nothing; the second to share its prefix snapshots where the match ends (the cached KV
        blocks remember the first), and the third starts there."""
        last = self.prompt_boundary(num_prompt_tokens)
        wanted = {chain.matched} if 0 < chain.matched <= last else set()
        if (self.snapshot_all or chain.every_boundary) and last:
            wanted.update(range(self.snapshot_interval, last, self.snapshot_interval))
            wanted.add(last)
        known = len(chain.digests) * self.block_size       # digests of blocks beyond it are not made yet
        have = {b for b in wanted if b <= known and (e := self.entries.get(chain.digests[b // self.block_size - 1]))
                is not None and e.snapshot is not None}
        return tuple(sorted(wanted - have))

    def expect_continuation(self, request_id: str) -> None:
        """A later request will extend this one's tokens (the next turn of a session): snapshot
        every boundary of its prompt, so that turn starts from the cache under either policy."""
        self._chains.setdefault(request_id, _RequestChain()).every_boundary = True

    def _cached_path(self, digests: Sequence[bytes]) -> tuple[list[tuple], int | None]:
        """How far a chain is cached, on the device or in the host tier: ``(entry or None, host
        record or None)`` per block from the first, and the index of the deepest one with a
        snapshot (None: none). Reads only."""
        found, deepest = [], None
        for k, digest in enumerate(digests):
            entry = self.entries.get(digest)
            record = self.host.get(digest) if self.host is not None else None
            if entry is None and (record is None or "kv" not in record):
                break
            found.append((entry, record))
            if (entry is not None and entry.snapshot is not None) or (record is not None and "snapshot" in record):
                deepest = k
        return found, deepest

    def lookup(self, request_id: str, tokens) -> PrefixHit | None:
        """The longest usable prefix of a new request's tokens (``admitted`` counts it), with
        what it needs restored from the host tier: the path's blocks that are there, and one
        snapshot, the deepest (snapshots shallower on the path stay where they are)."""
        chain = self._chains.setdefault(request_id, _RequestChain())
        chain_digests(tokens, self.block_size, chain.digests)
        limit = self.prompt_boundary(len(tokens)) // self.block_size
        # 1. how far the chain is cached (device or host), and its deepest snapshot
        found, deepest = self._cached_path(chain.digests[:limit])
        chain.matched = len(found) * self.block_size
        for entry, _ in found:
            if entry is not None:
                entry.reused = True
        self._planned(chain, len(tokens))               # (at the first lookup: it needs the match)
        if deepest is None:
            return None
        # 2. the path to it on the device, then the deepest snapshot on that path
        wanted = chain.digests[:deepest + 1]
        on_device = [self.entries[d].block for d in wanted if d in self.entries]
        pinned = len(on_device) < len(wanted)   # restores ahead: hold the path's blocks so their
        if pinned:                              # reservations spare them (restored ones join the pin)
            self._pin(on_device)
        path: list[CacheEntry] = []
        try:
            for k, digest in enumerate(wanted):
                entry = self.entries.get(digest) or self._restore_blocks(digest, (k + 1) * self.block_size)
                if entry is None:
                    break
                path.append(entry)
            while path and path[-1].snapshot is None and not self._restore_snapshot(path[-1]):
                path.pop()
        finally:
            if pinned:
                self._unpin()
        if not path:
            return None
        self._clock += 1
        for e in path:
            e.last_used = self._clock
            if self._routable.pop(e.digest, False) is None:      # most recently used last
                self._routable[e.digest] = None
        head_blocks = []
        for e in path[1:]:
            if e.head_block is None:
                break
            head_blocks.append(e.head_block)
        return PrefixHit(path[-1].num_tokens, [e.block for e in path], head_blocks, path[-1].snapshot,
                         path[-1].hidden)

    # ------------------------------------------------------------------ the host tier
    def _pin(self, blocks: list[int]) -> None:
        """The pin table: ``blocks`` (cached) held in it, so no reservation evicts them; a
        restore's reservations add their blocks to it."""
        self.kv_pool.attach(_PIN, blocks)
        if self.head_pool is not None:
            self.head_pool.attach(_PIN, [])

    def _unpin(self) -> None:
        self.kv_pool.free(_PIN)
        if self.head_pool is not None:
            self.head_pool.free(_PIN)

    def _restore_blocks(self, digest: bytes, num_tokens: int) -> CacheEntry | None:
        """A host record's main (and head) block back onto the device as a new entry, reserved
        in the pin table; None if it has no block part or the pool has no room. The block
        parts leave the host tier; a snapshot part stays there until a lookup wants it."""
        record, xp = self.host.get(digest), self.xp
        if record is None or "kv" not in record or not self.kv_pool.reserve(
                _PIN, (len(self.kv_pool.block_table(_PIN)) + 1) * self.block_size):
            return None
        block = self.kv_pool.block_table(_PIN)[-1]
        for arr, host in zip(self.kv_arrays, record["kv"]):
            arr[block] = xp.asarray(host)
        self._add_entry(digest, num_tokens, block)
        entry = self.entries[digest]
        entry.reused = True
        if "head" in record and self.head_pool is not None and self.head_pool.reserve(
                _PIN, (len(self.head_pool.block_table(_PIN)) + 1) * self.block_size):
            head_block = self.head_pool.block_table(_PIN)[-1]
            for arr, host in zip(self.head_arrays, record["head"]):
                arr[head_block] = xp.asarray(host)
            entry.head_block = head_block
            self._by_head_block[head_block] = digest
            self.head_pool.mark_cached(head_block)
        for part in ("kv", "head"):
            self.host.drop(digest, part)
        self.stats.num_restored += 1
        return entry

    def _restore_snapshot(self, entry: CacheEntry) -> bool:
        """The entry's snapshot (and hidden rows) back from the host tier into a bank slot,
        reclaiming the least recently used other slot if none is free; False if it cannot."""
        record = self.host.get(entry.digest) if self.host is not None else None
        if record is None or "snapshot" not in record:
            return False
        conv, recurrent, length = record["snapshot"]
        if length != entry.num_tokens:                # (an imported record's digest and snapshot disagree)
            return False
        conv, recurrent = self.xp.asarray(conv), self.xp.asarray(recurrent)
        slot = self.bank.put_snapshot(conv, recurrent, length)
        if slot is None and self._free_a_snapshot_slot(keep=entry):
            slot = self.bank.put_snapshot(conv, recurrent, length)
        if slot is None:
            return False
        entry.snapshot = slot
        entry.hidden = self.xp.asarray(record["hidden"]) if "hidden" in record else None
        for part in ("snapshot", "hidden"):
            self.host.drop(entry.digest, part)
        self.stats.num_restored += 1
        return True

    def _offload(self, entry: CacheEntry, with_blocks: bool) -> None:
        """Copy an entry's parts to the host tier before the device lets go of them: only a
        reused entry's, unless ``offload_all`` (each copy is a device-to-host transfer on the step
        path: for one-off prompts they cost a 1.4 B model 10x its TTFT on the H200 at C=64)."""
        if self.host is None or not (entry.reused or self.offload_all):
            return
        parts = self._block_parts(entry) if with_blocks else {}
        if entry.snapshot is not None:
            parts.update(self._snapshot_parts(entry))
        if parts:
            self.host.put(entry.digest, parts)
            self.stats.num_offloaded += 1

    # ------------------------------------------------------------------ moving a prefix
    def export_records(self, tokens) -> list[tuple[bytes, bytes]]:
        """What another engine of the same model needs to start a request with ``tokens`` from
        this cache's longest snapshotted prefix of them: ``(digest, pack_record(...))`` for each
        block of the path, the deepest with its snapshot (and the head's hidden rows). Empty
        when no snapshot of it is here. Read-only: device parts are copied, nothing moves."""
        digests = chain_digests(tokens, self.block_size, [])[:self.prompt_boundary(len(tokens)) // self.block_size]
        found, deepest = self._cached_path(digests)
        if deepest is None:
            return []
        out = []                  # parts copied for the path up to the deepest snapshot only
        for k, (digest, (entry, record)) in enumerate(zip(digests, found[:deepest + 1])):
            parts = self._block_parts(entry) if entry is not None else {
                p: record[p] for p in ("kv", "head") if p in record}
            if k == deepest:
                parts.update(self._snapshot_parts(entry) if entry is not None and entry.snapshot is not None else {
                    p: record[p] for p in ("snapshot", "hidden") if p in record})
            out.append((digest, pack_record(parts)))
        return out

    def import_records(self, records: Sequence[tuple[bytes, bytes]]) -> int:
        """Another engine's ``export_records`` into the host tier: the next lookup of that prompt
        restores them like entries of its own (marked reused). Returns the prompt tokens they
        cover (0 without a host tier). ValueError if a record's arrays do not fit this engine's
        pools (another model)."""
        if self.host is None or not records:
            return 0
        unpacked = []
        for item in records:
            try:
                digest, blob = item
                if not isinstance(digest, bytes) or not isinstance(blob, bytes):
                    raise TypeError("a record is a (digest, blob) pair of bytes")
                record = unpack_record(blob)
            except Exception as e:               # whatever a malformed record breaks in the unpacking
                raise ValueError(f"not a prefix record (what export_prefix gives): {e}") from None
            self._check_record(record)
            unpacked.append((digest, record))
        for digest, record in unpacked:
            entry = self.entries.get(digest)
            if entry is not None:                 # its blocks are here: at most its snapshot is news
                record = {p: v for p, v in record.items() if p in ("snapshot", "hidden") and entry.snapshot is None}
            if record:
                self.host.put(digest, record)
        return len(unpacked) * self.block_size

    def _block_parts(self, entry: CacheEntry) -> dict:
        parts = {"kv": [_to_host(a[entry.block]) for a in self.kv_arrays]}
        if entry.head_block is not None and self.head_arrays:
            parts["head"] = [_to_host(a[entry.head_block]) for a in self.head_arrays]
        return parts

    def _snapshot_parts(self, entry: CacheEntry) -> dict:
        conv, recurrent, length = self.bank.snapshot_arrays(entry.snapshot)
        parts = {"snapshot": (_to_host(conv), _to_host(recurrent), int(length))}
        if entry.hidden is not None:
            parts["hidden"] = _to_host(entry.hidden)
        return parts

    def _check_record(self, record: dict) -> None:
        """ValueError unless ``record`` (unpacked) holds parts of this engine's shapes."""
        parts = {"kv": list, "head": list, "snapshot": tuple, "hidden": np.ndarray}
        if not record or any(not isinstance(v, parts.get(k, type(None))) for k, v in record.items()):
            raise ValueError(f"not a prefix record (what export_prefix gives): parts {list(record)!r}")
        if "snapshot" in record:
            length = record["snapshot"][2] if len(record["snapshot"]) == 3 else None
            if type(length) is not int or length <= 0 or length % self.block_size:
                raise ValueError("a prefix record's state snapshot has no whole-block length")
            if self.hidden_row is not None and "hidden" not in record:
                raise ValueError("a prefix record's snapshot has no hidden rows for the MTP head (exported "
                                 "with MTP off?)")
        hidden = record.get("hidden")
        wanted_hidden = (self.block_size, self.hidden_row[0]) if self.hidden_row is not None else None
        if hidden is not None and (hidden.ndim != 2 or hidden.shape[0] != self.block_size or wanted_hidden and (
                hidden.shape != wanted_hidden or hidden.dtype != self.hidden_row[1])):
            raise ValueError("a prefix record's hidden rows are not one block's of this model's hidden states")
        wanted = {"kv": [a.shape[1:] for a in self.kv_arrays], "head": [a.shape[1:] for a in self.head_arrays]}
        for part in ("kv", "head"):
            if part in record and [tuple(a.shape) for a in record[part]] != [tuple(s) for s in wanted[part]]:
                raise ValueError(f"a prefix record's {part} blocks {[tuple(a.shape) for a in record[part]]} do not "
                                 f"fit this engine's pools' {[tuple(s) for s in wanted[part]]} (another model, or "
                                 f"another kv_block_size: {self.block_size} tokens here)")
        if "snapshot" in record:
            conv, recurrent, _ = record["snapshot"]
            if conv.shape != self.bank.snapshot_conv.shape[1:] or recurrent.shape != self.bank.snapshot_recurrent.shape[1:]:
                raise ValueError("a prefix record's state snapshot does not fit this engine's state bank")

    def _free_a_snapshot_slot(self, keep: CacheEntry) -> bool:
        victim = min((e for e in self.entries.values() if e.snapshot is not None and e is not keep),
                     key=lambda e: e.last_used, default=None)
        if victim is None:
            return False
        self._offload(victim, with_blocks=False)
        self._drop_snapshot(victim)
        return True

    def admitted(self, request_id: str, num_tokens: int, hit: PrefixHit | None) -> None:
        """The request was admitted, from ``hit`` or from scratch (``num_tokens`` looked up):
        counted; after a hit its head blocks past the shared ones are stale."""
        self.stats.queries += num_tokens
        if hit is None:
            return
        self.stats.hits += hit.num_tokens
        self.stats.num_requests_hit += 1
        chain = self._chains[request_id]
        num_head_blocks = hit.num_tokens // self.block_size - 1
        chain.stale_head = range(len(hit.head_blocks), num_head_blocks)
        chain.num_head_registered = chain.num_registered = 0

    # ------------------------------------------------------------------ registration
    def committed(self, request_id: str, tokens, num_prompt_tokens: int, num_computed: int, num_head: int,
                  pending_rows: Callable[[str, int, int], Array] | None) -> None:
        """After a step: enter the request's newly full blocks (main and head), and take a
        snapshot when ``num_computed`` sits on one of its prompt's boundaries (``tokens``: the
        prompt and the output so far). ``pending_rows(request_id, offset, count)``: the main
        model's hidden rows from position ``num_head + offset`` (MTP on; the proposer's)."""
        chain = self._chains.get(request_id)
        if chain is None:
            chain = self._chains[request_id] = _RequestChain()
        full = num_computed // self.block_size
        if full > chain.num_registered:           # (most decode steps fill no block: nothing to do)
            chain_digests(tokens[:num_computed], self.block_size, chain.digests)
            table = self.kv_pool.block_table(request_id)
            for k in range(chain.num_registered, full):
                digest = chain.digests[k]
                if digest not in self.entries:
                    self._add_entry(digest, (k + 1) * self.block_size, table[k])
            chain.num_registered = full
        # head block j waits for main block j + 1's entry: most decode steps have nothing to add
        if (self.head_pool is not None and (chain.num_head_registered + 1) * self.block_size <= num_head
                and chain.num_head_registered + 1 < len(chain.digests)):
            self._register_head(request_id, chain, num_head)
        if num_computed >= num_prompt_tokens:      # past every prompt boundary: no snapshot due (decode steps)
            return
        boundary = self.prompt_boundary(num_prompt_tokens)
        if num_computed and num_computed <= boundary and num_computed in self._planned(chain, num_prompt_tokens):
            entry = self.entries[chain.digests[num_computed // self.block_size - 1]]
            if entry.snapshot is None:
                hidden = None if pending_rows is None else (
                    lambda: pending_rows(request_id, entry.num_tokens - self.block_size - num_head, self.block_size))
                self._snapshot(request_id, entry, hidden)

    def _add_entry(self, digest: bytes, num_tokens: int, block: int) -> None:
        if self.kv_pool.is_cached(block):         # a block of another prefix (cannot happen) stays put
            raise AssertionError(f"block {block} is cached under another prefix")
        self._clock += 1
        self.entries[digest] = CacheEntry(digest, num_tokens, block, last_used=self._clock)
        self._by_block[block] = digest
        self.kv_pool.mark_cached(block)
        if num_tokens <= ROUTED_PREFIX_TOKENS:
            self._routable[digest] = None
            self.routing_version += 1

    def _register_head(self, request_id: str, chain: _RequestChain, num_head: int) -> None:
        """Head block j is fixed once num_head >= (j+1)*bs; it is kept under entry j+1."""
        table = self.head_pool.block_table(request_id) if request_id in self.head_pool else []
        j = chain.num_head_registered
        while (j + 1) * self.block_size <= num_head and j + 1 < len(chain.digests) and j < len(table):
            entry = self.entries.get(chain.digests[j + 1])
            block = table[j]
            if (entry is not None and entry.head_block is None and j not in chain.stale_head
                    and not self.head_pool.is_cached(block)):
                entry.head_block = block
                self._by_head_block[block] = entry.digest
                self.head_pool.mark_cached(block)
            j += 1
        chain.num_head_registered = j

    def _snapshot(self, request_id: str, entry: CacheEntry, hidden_rows) -> None:
        slot = self.bank.save_snapshot(request_id)
        if slot is None:
            if not self._free_a_snapshot_slot(keep=entry):
                return
            slot = self.bank.save_snapshot(request_id)
        entry.snapshot = slot
        if hidden_rows is not None:
            entry.hidden = hidden_rows()
        self.stats.num_snapshots_taken += 1

    def _drop_snapshot(self, entry: CacheEntry) -> None:
        self.bank.free_snapshot(entry.snapshot)
        entry.snapshot, entry.hidden = None, None

    # ------------------------------------------------------------------ routing
    def routing_index(self, limit: int) -> bytes:
        """The ``limit`` most recently used digests within ``ROUTED_PREFIX_TOKENS``, each cut to
        ``ROUTING_DIGEST_BYTES``, concatenated (newest first): what this cache tells routers."""
        newest = itertools.islice(reversed(self._routable), limit)
        return b"".join(d[:ROUTING_DIGEST_BYTES] for d in newest)

    # ------------------------------------------------------------------ forgetting
    def forget_request(self, request_id: str) -> None:
        """The request finished: its bookkeeping goes (its blocks stay cached in the pools)."""
        self._chains.pop(request_id, None)

    def preempted(self, request_id: str) -> None:
        """Its head blocks are gone: nothing of them is stale any more, nothing registered."""
        chain = self._chains.get(request_id)
        if chain is not None:
            chain.stale_head, chain.num_head_registered, chain.num_registered = range(0), 0, 0

    def _block_evicted(self, block: int) -> None:
        digest = self._by_block.pop(block, None)
        entry = self.entries.pop(digest, None) if digest is not None else None
        if entry is None:
            return
        if self._routable.pop(digest, False) is None:
            self.routing_version += 1
        self._offload(entry, with_blocks=True)
        if entry.snapshot is not None:
            self._drop_snapshot(entry)
        if entry.head_block is not None:
            self._by_head_block.pop(entry.head_block, None)
            self.head_pool.uncache(entry.head_block)
        self.stats.num_evicted_entries += 1

    def _head_block_evicted(self, block: int) -> None:
        digest = self._by_head_block.pop(block, None)
        if digest is not None and digest in self.entries:
            self.entries[digest].head_block = None

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Every entry's block is cached under it alone, head blocks likewise, snapshot slots used
        by one entry each, and no bookkeeping of finished requests."""
        snapshots = [e.snapshot for e in self.entries.values() if e.snapshot is not None]
        if len(set(snapshots)) != len(snapshots):
            raise AssertionError("a snapshot slot is held by two entries")
        if len(snapshots) + self.bank.num_free_snapshots != len(self.bank.snapshot_conv):
            raise AssertionError("snapshot slots held by no entry")
        for digest, e in self.entries.items():
            if self._by_block.get(e.block) != digest or not self.kv_pool.is_cached(e.block):
                raise AssertionError(f"entry of {e.num_tokens} tokens: block {e.block} not cached under it")
            if e.head_block is not None and (self._by_head_block.get(e.head_block) != digest
                                             or not self.head_pool.is_cached(e.head_block)):
                raise AssertionError(f"entry of {e.num_tokens} tokens: head block {e.head_block} not cached under it")
        if self.kv_pool.num_cached_blocks != len(self.entries):
            raise AssertionError("cached main blocks that no entry names")
        if self.head_pool is not None and self.head_pool.num_cached_blocks != len(self._by_head_block):
            raise AssertionError("cached head blocks that no entry names")
        if self.host is not None and self.host.nbytes > self.host.budget_bytes:
            raise AssertionError(f"host tier holds {self.host.nbytes} bytes, budget {self.host.budget_bytes}")
        if _PIN in self.kv_pool:
            raise AssertionError("a restore's pin table was left behind")
        if any(d not in self.entries for d in self._routable):
            raise AssertionError("the routing index names an entry the cache no longer holds")

    def check_requests(self, live: set[str]) -> None:
        if not set(self._chains) <= live:
            raise AssertionError("prefix-cache bookkeeping of finished requests")
