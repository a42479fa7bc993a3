"""KVPool: reservation, commit, trim, free, slot arithmetic and integrity under random traffic."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mtpserve.engine.kv_pool import KVPool


def test_reserve_commit_trim_free_move_blocks_between_states():
    pool = KVPool(num_blocks=9, block_size=4)              # block 0 is scratch: 8 usable
    assert pool.num_free_blocks == 8
    assert pool.reserve("a", 6)                             # prompt chunk of 6 -> 2 blocks
    assert (pool.num_free_blocks, pool.num_reserved_blocks, pool.num_committed_blocks) == (6, 2, 0)
    pool.commit("a", 6)
    assert (pool.num_reserved_blocks, pool.num_committed_blocks) == (0, 2)
    assert pool.reserve("a", 6 + 5)                         # decode + 4 drafts -> slots up to 11
    assert pool.num_reserved_blocks == 1 and pool.committed_len("a") == 6
    pool.commit("a", 8)                                     # 2 of 5 kept: 2 blocks fully used
    assert pool.num_reserved_blocks == 1                    # the draft block stays reserved
    assert pool.trim("a") == 1 and pool.num_free_blocks == 6
    assert pool.trim("a") == 0
    pool.check_integrity()
    assert pool.free("a") == 2 and pool.num_free_blocks == 8
    assert pool.free("a") == 0                              # unknown / already freed
    pool.check_integrity()


def test_reserve_is_all_or_nothing_and_never_shrinks():
    pool = KVPool(num_blocks=5, block_size=4)               # 4 usable
    assert pool.reserve("a", 8)
    before = (pool.block_table("a"), pool.num_free_blocks)
    assert not pool.can_reserve("a", 17) and not pool.reserve("a", 17)   # needs 3 more, 2 free
    assert (pool.block_table("a"), pool.num_free_blocks) == before
    assert not pool.reserve("b", 12)
    assert "b" not in pool                                   # a refused newcomer is not registered
    assert pool.reserve("a", 3) and pool.block_table("a") == before[0]
    assert pool.num_blocks_needed("a", 16) == 2 and pool.reserve("a", 16)
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_block_array_is_the_table_kept_until_it_changes():
    pool = KVPool(num_blocks=9, block_size=4)
    assert pool.reserve("a", 6)
    arr = pool.block_array("a")
    assert arr.tolist() == pool.block_table("a") and arr.dtype.name == "int32"
    with pytest.raises(ValueError):
        arr[0] = 7                                         # read-only: steps share it
    pool.commit("a", 6)
    assert pool.reserve("a", 7) and pool.block_array("a") is arr   # no new block: the same copy
    assert pool.reserve("a", 9)                                    # a third block
    assert pool.block_array("a").tolist() == pool.block_table("a") and len(pool.block_array("a")) == 3
    assert arr.tolist() == pool.block_table("a")[:2]               # the copy a step took is unchanged
    assert pool.trim("a") == 1 and pool.block_array("a").tolist() == pool.block_table("a")
    pool._arrays["a"] = pool.block_array("a")[:1]                  # a stale copy: the integrity check says so
    with pytest.raises(AssertionError, match="block_array"):
        pool.check_integrity()
    pool.free("a")
    with pytest.raises(AssertionError, match="unknown request"):
        pool.block_array("a")


def test_scratch_blocks_are_never_handed_out():
    pool = KVPool(num_blocks=6, block_size=2, num_scratch_blocks=2)
    assert pool.reserve("a", 8) and not pool.reserve("b", 1)
    assert sorted(pool.block_table("a")) == [2, 3, 4, 5]
    none = KVPool(num_blocks=3, block_size=2, num_scratch_blocks=0)
    assert none.reserve("a", 6) and sorted(none.block_table("a")) == [0, 1, 2]


def test_slot_follows_the_docstring_diagram():
    pool = KVPool(num_blocks=10, block_size=4)
    pool.reserve("x", 1)
    pool._tables["x"] = [7, 2, 9]                            # the diagram's table
    pool._refs = {7: 1, 2: 1, 9: 1}
    pool._free = type(pool._free)(b for b in range(1, 10) if b not in (7, 2, 9))
    pool.check_integrity()
    assert pool.slot("x", 5) == 9 and pool.slot("x", 10) == 38 and pool.slot("x", 0) == 28
    assert pool.slots("x", 3, 9).tolist() == [pool.slot("x", p) for p in range(3, 9)]
    with pytest.raises(AssertionError):
        pool.slot("x", 12)


def test_commit_rejects_out_of_range_lengths():
    pool = KVPool(num_blocks=4, block_size=4)
    pool.reserve("a", 5)
    pool.commit("a", 5)
    with pytest.raises(AssertionError, match="must lie in"):
        pool.commit("a", 4)                                  # committed tokens never go back
    with pytest.raises(AssertionError, match="must lie in"):
        pool.commit("a", 9)                                  # beyond the reserved slots
    with pytest.raises(AssertionError, match="unknown request"):
        pool.commit("zzz", 0)


def test_check_integrity_catches_a_block_owned_twice():
    pool = KVPool(num_blocks=6, block_size=4)
    pool.reserve("a", 4), pool.reserve("b", 4)
    pool._tables["b"].append(pool._tables["a"][0])
    with pytest.raises(AssertionError, match="owned by"):
        pool.check_integrity()
    lost = KVPool(num_blocks=6, block_size=4)
    lost._free.popleft()
    with pytest.raises(AssertionError, match="accounted for"):
        lost.check_integrity()


class KVTraffic(RuleBasedStateMachine):
    """Steps of several requests: reserve lookahead, commit a kept prefix, trim, cancel/preempt."""

    @initialize(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4, 16]),
                num_scratch=st.integers(0, 1))
    def make(self, num_blocks, block_size, num_scratch):
        self.pool = KVPool(num_blocks, block_size, num_scratch)
        self.committed = {}                                   # the model: request -> length
        self.evicted: list[int] = []
        self.pool.on_evict = self.evicted.append

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def cache_full_blocks(self, data):
        """The prefix cache keeps a request's full committed blocks."""
        rid = data.draw(st.sampled_from(sorted(self.committed)))
        for b in self.pool.block_table(rid)[:self.committed[rid] // self.pool.block_size]:
            self.pool.mark_cached(b)

    @precondition(lambda self: self.pool.num_cached_blocks)
    @rule(rid=st.integers(6, 9), data=st.data())
    def attach_cached(self, rid, data):
        """A new request starts from cached blocks (held by other tables, or evictable)."""
        if rid in self.committed:
            return
        cached = sorted(self.pool._cached)
        blocks = data.draw(st.lists(st.sampled_from(cached), unique=True, max_size=4))
        before_free = self.pool.num_free_blocks
        newly_held = sum(1 for b in blocks if b in self.pool._evictable)
        self.pool.attach(rid, blocks)
        self.committed[rid] = len(blocks) * self.pool.block_size
        assert self.pool.num_free_blocks == before_free - newly_held

    @rule(rid=st.integers(0, 5), num_fed=st.integers(0, 40))
    def reserve(self, rid, num_fed):
        before_free = self.pool.num_free_blocks
        need = self.pool.num_blocks_needed(rid, self.committed.get(rid, 0) + num_fed)
        evicted_before = len(self.evicted)
        ok = self.pool.reserve(rid, self.committed.get(rid, 0) + num_fed)
        assert ok == (need <= before_free)
        for b in self.evicted[evicted_before:]:        # reclaimed cached blocks: forgotten, now rid's own
            assert not self.pool.is_cached(b) and b in self.pool.block_table(rid)
        if ok:
            self.committed.setdefault(rid, 0)
            assert self.pool.num_free_blocks == before_free - need
        else:
            assert self.pool.num_free_blocks == before_free

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def commit_prefix(self, data):
        rid = data.draw(st.sampled_from(sorted(self.committed)))
        cap = len(self.pool.block_table(rid)) * self.pool.block_size
        n = data.draw(st.integers(self.committed[rid], cap))
        self.pool.commit(rid, n)
        self.committed[rid] = n

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def trim(self, data):
        rid = data.draw(st.sampled_from(sorted(self.committed)))
        self.pool.trim(rid)
        assert self.pool.num_reserved_blocks == sum(
            len(self.pool.block_table(r)) - -(-self.committed[r] // self.pool.block_size)
            for r in self.committed)

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def cancel_or_preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.committed)))
        held = len(self.pool.block_table(rid))
        assert self.pool.free(rid) == held
        del self.committed[rid]

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_integrity()
        for rid, n in self.committed.items():
            assert self.pool.committed_len(rid) == n
            table = self.pool.block_table(rid)
            assert self.pool.block_array(rid).tolist() == table       # the step's copy is never stale
            if n:
                assert self.pool.slot(rid, n - 1) // self.pool.block_size == table[(n - 1) // self.pool.block_size]

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for rid in list(self.committed):
            self.pool.free(rid)
        self.pool.check_integrity()
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks
        assert self.pool.num_reserved_blocks == self.pool.num_committed_blocks == 0


TestKVTraffic = KVTraffic.TestCase
TestKVTraffic.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
