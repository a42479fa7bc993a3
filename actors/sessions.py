"""The sessions one replica holds, owned by its engine loop's owner thread (no Ray in here).

A session is a conversation sent with a session id (``x-session-id``, or ``session_id`` on a
handle). The table knows when each was last seen (reported to the planner, which places sessions
from it), which requests of it are in flight, and each session's last full token sequence: its
latest finished request's prompt and generated tokens, the next turn's prefix, which a replica
that stops gracefully exports (``EngineLoop.export_sessions``) for the replica that serves the
session next.

Bounds: a session not seen for ``ttl_s`` is forgotten unless a request of it is in flight; at most
``max_sessions`` (the most recently seen, and every active one); the remembered sequences take at
most ``max_tokens`` tokens (4 bytes each), the least recently finished dropped first.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

MAX_SESSION_ID_LENGTH = 256         # longer ids are refused: session tables (and the planner's) hold every id seen
MAX_REPORTED_SESSIONS = 10_000      # sessions a replica remembers (and reports) at most, besides active ones
MAX_REMEMBERED_TOKENS = 1 << 23     # tokens of the sessions' last sequences a replica keeps (32 MiB)


def check_session_id(session_id: str | None) -> None:
    """ValueError for a session id no table should hold (over ``MAX_SESSION_ID_LENGTH`` characters)."""
    if session_id is not None and len(session_id) > MAX_SESSION_ID_LENGTH:
        raise ValueError(f"a session id is at most {MAX_SESSION_ID_LENGTH} characters, got {len(session_id)}")


class SessionTable:
    """See the module docstring. Every method runs on one thread (the engine loop's owner)."""

    def __init__(self, ttl_s: float = 600.0, max_sessions: int = MAX_REPORTED_SESSIONS,
                 max_tokens: int = MAX_REMEMBERED_TOKENS):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._seen: dict[str, float] = {}                        # session -> last seen (monotonic)
        self._turns: dict[str, tuple[str, array]] = {}           # request id -> (session, prompt + output so far)
        self._last: OrderedDict[str, array] = OrderedDict()      # session -> its last sequence; least recent first
        self._num_tokens = 0                                     # in _last

    @property
    def session_ids(self) -> tuple[str, ...]:
        return tuple(self._seen)

    def start(self, request_id: str, session_id: str, prompt_ids: list[int], now: float) -> None:
        """A request of the session arrived (its prompt's token ids)."""
        self._seen[session_id] = now
        self._turns[request_id] = (session_id, array("i", prompt_ids))

    def extend(self, request_id: str, token_ids: list[int]) -> None:
        """Tokens a request generated (any request: those without a session are ignored)."""
        turn = self._turns.get(request_id)
        if turn is not None and token_ids:
            turn[1].extend(token_ids)

    def finish(self, request_id: str) -> None:
        """The request ended (any way, any request): its tokens become its session's last sequence."""
        turn = self._turns.pop(request_id, None)
        if turn is None:
            return
        session_id, tokens = turn
        previous = self._last.pop(session_id, None)
        self._num_tokens += len(tokens) - (len(previous) if previous is not None else 0)
        self._last[session_id] = tokens
        while self._num_tokens > self.max_tokens and len(self._last) > 1:
            self._num_tokens -= len(self._last.popitem(last=False)[1])

    def last_sequences(self):
        """(session, its last token sequence), the most recently finished first, one at a time
        (an export that stops at its deadline or budget converts no more of them than it reads)."""
        for s, tokens in reversed(list(self._last.items())):
            yield s, tokens.tolist()

    def prune(self, now: float) -> None:
        """Forget sessions past their TTL (unless active) and beyond ``max_sessions``."""
        active = {s for s, _ in self._turns.values()}
        seen = {s: t for s, t in self._seen.items() if now - t < self.ttl_s or s in active}
        if len(seen) > self.max_sessions:                      # the newest ones, and every active one
            newest = sorted(seen, key=seen.get)[-self.max_sessions:]
            seen = {s: seen[s] for s in set(newest) | (active & set(seen))}
        dropped, self._seen = len(seen) < len(self._seen), seen
        if dropped:
            for s in [s for s in self._last if s not in seen]:
                self._num_tokens -= len(self._last.pop(s))
