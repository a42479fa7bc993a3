"""A replica's session table, without an engine: last-seen times, each session's last token
sequence (prompt + output of its latest finished request), bounds by TTL, count and tokens."""
from mtpserve.actors.sessions import SessionTable


def test_a_sessions_last_sequence_is_its_latest_finished_prompt_and_output():
    table = SessionTable()
    table.start("r1", "s", [1, 2, 3], now=0.0)
    table.extend("r1", [4, 5])
    table.extend("other", [9])                  # a request without a session: ignored
    assert list(table.last_sequences()) == [], "nothing until the request finishes"
    table.finish("r1")
    table.finish("other")
    assert list(table.last_sequences()) == [("s", [1, 2, 3, 4, 5])]
    table.start("r2", "s", [1, 2, 3, 4, 5, 6], now=1.0)
    table.extend("r2", [7])
    table.start("r3", "t", [8], now=1.0)
    table.finish("r3")
    table.finish("r2")
    assert list(table.last_sequences()) == [("s", [1, 2, 3, 4, 5, 6, 7]), ("t", [8])], "most recently finished first"
    assert set(table.session_ids) == {"s", "t"}


def test_remembered_tokens_are_bounded_least_recent_first():
    table = SessionTable(max_tokens=10)
    for i, sid in enumerate("abc"):
        table.start(sid, sid, [i] * 4, now=float(i))
        table.finish(sid)
    assert [s for s, _ in list(table.last_sequences())] == ["c", "b"], "12 tokens > 10: a's are dropped"
    assert table._num_tokens == 8


def test_expired_sessions_are_forgotten_with_their_sequences_unless_active():
    table = SessionTable(ttl_s=10.0)
    table.start("a", "old", [1], now=0.0)
    table.finish("a")
    table.start("b", "busy", [2], now=0.0)          # still in flight at the prune
    table.start("c", "new", [3], now=8.0)
    table.finish("c")
    table.prune(now=11.0)
    assert set(table.session_ids) == {"busy", "new"}
    assert list(table.last_sequences()) == [("new", [3])] and table._num_tokens == 1


def test_the_session_count_is_bounded_keeping_the_newest_and_the_active():
    table = SessionTable(max_sessions=2)
    table.start("x", "active", [1], now=0.0)
    for i in range(4):
        table.start(f"r{i}", f"s{i}", [i], now=1.0 + i)
        table.finish(f"r{i}")
    table.prune(now=5.0)
    assert set(table.session_ids) == {"s2", "s3", "active"}
    assert [s for s, _ in list(table.last_sequences())] == ["s3", "s2"]
