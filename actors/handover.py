"""Sessions' cached prefixes handed over when a replica stops gracefully (no Ray in here).

    stopping replica (Worker.shutdown,           planner actor                     next replica (Worker.open)
    Serve's __del__ after its drain)             (PlannerState.handovers)
    ------------------------------------         ------------------------------    ---------------------------------
    EngineLoop.export_sessions: each session's
    last token sequence's cached prefix, most
    recently used first, within a byte budget
    planner.hand_over(replica, {session: -->     HandoverStore.put: a byte budget
      records}): bytes in the call, waited        (oldest dropped), a TTL
      for, before the replica exits              WorkerPlan.handover_sessions -->  the ids, kept until the next change
                                                 take(session), removes them <--   the first request of a listed session:
                                                                                   import_prefix, then the request

How the next replica learns which sessions have records: the reply to the report every replica
already sends every ``report_interval_s`` carries the store's session ids, and only when they
changed (a version, as the prefix indexes in the router's view). That adds no call to any request:
a session's first request on its new replica makes the one planner call (``take``) that fetches
its records, and every other request none. The alternatives cost more: asking the planner on every
session request puts it on the per-request path; asking for every session new to a replica makes
every new conversation pay a round trip; the router knows where it sends a session but has no
channel to the replica besides the request itself. The price: a request that arrives within one
report interval of the hand-over (or on a replica that has not reported yet) does not know and
recomputes its prefix, as before. Records are a cache: whatever is lost (a budget, a TTL, a
restarted planner, a crashed replica that never handed anything over) only costs recompute.
"""

from __future__ import annotations

import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

Records = list[tuple[bytes, bytes]]      # (digest, msgpack record): PrefixCache.export_records
DEFAULT_HANDOVER_GIB = 1.0
MAX_HELD_SESSIONS = 10_000               # bounds the id set each report's reply may carry


def records_size(records: Records) -> int:
    """Bytes a prefix's records take (digests and packed records)."""
    return sum(len(digest) + len(blob) for digest, blob in records)


@dataclass
class HandoverCounts:
    """What a store did since the planner started, for /metrics: sessions and bytes by event
    (``handed_over``, ``taken``, ``dropped`` for the budget or a newer hand-over, ``expired``),
    and what it holds now."""
    sessions: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    num_held_sessions: int = 0
    num_held_bytes: int = 0


class HandoverStore:
    """The planner's handed-over records, per session: at most ``max_bytes`` (and
    MAX_HELD_SESSIONS sessions), the oldest hand-over dropped first; a hand-over older than
    ``ttl_s`` expires (the session table's TTL: a session gone that long is not coming back)."""

    def __init__(self, max_bytes: int = int(DEFAULT_HANDOVER_GIB * 2**30), ttl_s: float = 600.0,
                 max_sessions: int = MAX_HELD_SESSIONS):
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._held: OrderedDict[str, tuple[Records, int, float]] = OrderedDict()   # session -> (records,
        self.num_bytes = 0                                                          # bytes, put at); oldest first
        self._epoch = uuid.uuid4().hex[:8]           # a restarted planner's versions never match an old one's
        self._changes = 0
        self._sessions: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()

    @property
    def version(self) -> tuple[str, int]:
        """Changes whenever the set of held sessions does."""
        return self._epoch, self._changes

    def session_ids(self) -> frozenset[str]:
        return frozenset(self._held)

    def put(self, session_id: str, records: Records, now: float) -> bool:
        """Hold a session's records (replacing an older hand-over of it); False if they alone are
        over the budget. Older hand-overs are dropped until the store is within its bounds."""
        size = records_size(records)
        self._remove(session_id, "dropped")
        if not records or size > self.max_bytes:
            self._count("dropped", size)
            return False
        self._held[session_id] = (records, size, now)
        self.num_bytes += size
        self._changes += 1
        self._count("handed_over", size)
        while self.num_bytes > self.max_bytes or len(self._held) > self.max_sessions:
            self._remove(next(iter(self._held)), "dropped")
        return True

    def take(self, session_id: str) -> Records | None:
        """The session's records, removed from the store; None if it holds none."""
        held = self._remove(session_id, "taken")
        return None if held is None else held[0]

    def expire(self, now: float) -> None:
        while self._held:
            session_id, (_, _, put_at) = next(iter(self._held.items()))
            if now - put_at <= self.ttl_s:
                return
            self._remove(session_id, "expired")

    def counts(self) -> HandoverCounts:
        return HandoverCounts(dict(self._sessions), dict(self._bytes), len(self._held), self.num_bytes)

    def _remove(self, session_id: str, event: str) -> tuple[Records, int, float] | None:
        held = self._held.pop(session_id, None)
        if held is not None:
            self.num_bytes -= held[1]
            self._changes += 1
            self._count(event, held[1])
        return held

    def _count(self, event: str, size: int) -> None:
        self._sessions[event] += 1
        self._bytes[event] += size
