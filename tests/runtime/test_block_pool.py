"""Block pool and page tables: exact ids and queue order, then a stateful property test."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.block_pool import BlockPool, BlockPoolError
from runtime.kv_cache_manager import KVCacheManager
from tests.runtime.helpers import make_seq


def test_new_blocks_come_from_the_head_in_id_order():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert pool.free_queue.block_ids() == [3, 4, 5]


def test_scripted_sequence_gives_exact_ids_and_queue_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2
    pool.get_new_blocks(2)  # 3 4
    assert pool.cache_full_block(a[0], b"h0") and pool.cache_full_block(a[1], b"h1")
    pool.free_blocks(reversed(a))
    assert pool.free_queue.block_ids() == [5, 2, 1, 0]
    hit = pool.get_cached_block(b"h0")
    pool.touch([hit])  # out of the middle of the queue
    assert hit.block_id == 0 and hit.ref_count == 1
    assert pool.free_queue.block_ids() == [5, 2, 1]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [5, 2]
    evicted = pool.get_new_blocks(1)[0]  # the cached-free page 1 is reused: its hash goes
    assert evicted.block_id == 1 and pool.get_cached_block(b"h1") is None
    assert pool.num_evictions == 1 and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_free_returns_tail_blocks_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(10)))
    kv.allocate(seq, 10)
    assert kv.block_ids(seq) == [0, 1, 2]
    kv.free(seq)
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]


def test_duplicate_hash_keeps_the_first_page():
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_full_block(first, b"h")
    assert not pool.cache_full_block(second, b"h")
    assert pool.get_cached_block(b"h") is first and second.block_hash is None


def test_over_allocation_and_double_free_raise():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(BlockPoolError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(BlockPoolError):
        pool.free_blocks(blocks[:1])


def test_check_invariants_catches_a_leaked_page():
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    block.ref_count = 0  # a page dropped without going back to the queue
    with pytest.raises(BlockPoolError):
        pool.check_invariants()


def test_fork_shares_pages_and_copies_the_partial_one_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_seq("p", list(range(6)))  # pages: [0..3] full, [4, 5] partial
    kv.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1, parent.detokenizer.copy())
    kv.fork(parent, child)
    assert kv.block_ids(child) == kv.block_ids(parent) == [0, 1]
    assert [b.ref_count for b in kv.pool.blocks[:2]] == [2, 2]
    child.token_ids.append(9)
    copies = kv.allocate(child, 1)  # writes position 6, inside the shared partial page 1
    assert copies == [(1, 2)] and kv.block_ids(child) == [0, 2]
    parent.token_ids.append(7)
    assert kv.allocate(parent, 1) == []  # page 1 is the parent's alone now: written in place
    kv.check_invariants()


class PagesMachine(RuleBasedStateMachine):
    """Random admit / append / fork / finish / preempt / readmit against a shadow of page contents.

    Each page's slots hold the token written there; every live sequence must read its own
    computed tokens back through its page table, whatever was shared, copied or evicted.
    """

    BLOCK_SIZE = 4

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=10, block_size=self.BLOCK_SIZE)
        self.slots: dict[int, list[int | None]] = {b: [None] * self.BLOCK_SIZE for b in range(10)}
        self.live = []
        self.parked = []
        self.num_seqs = 0

    def _compute(self, seq, copies):
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])
        table = self.kv.block_ids(seq)
        for pos in range(seq.num_computed_tokens, seq.num_tokens):
            self.slots[table[pos // self.BLOCK_SIZE]][pos % self.BLOCK_SIZE] = seq.token_ids[pos]
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_full_blocks(seq, seq.num_tokens)

    def _admit(self, seq) -> bool:
        cached = self.kv.find_cached_prefix(seq)
        num_new = seq.num_tokens - len(cached) * self.BLOCK_SIZE
        if not self.kv.can_allocate(seq, num_new, cached):
            return False
        self._compute(seq, self.kv.allocate(seq, num_new, cached))
        self.live.append(seq)
        return True

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14), salt=st.sampled_from([None, b"x"]))
    def admit(self, tokens, salt):
        self.num_seqs += 1
        self._admit(make_seq(f"s{self.num_seqs}", tokens, salt))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if self.kv.can_allocate(seq, 1):
            self._compute(seq, self.kv.allocate(seq, 1))
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        self.num_seqs += 1
        child = parent.fork(self.num_seqs, parent.detokenizer.copy())
        self.kv.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.kv.free(seq)
        self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        self.live.remove(seq)
        self.parked.append(seq)

    @precondition(lambda self: self.parked)
    @rule()
    def readmit(self):
        seq = self.parked[0]
        if self._admit(seq):
            self.parked.pop(0)

    @invariant()
    def pages_add_up(self):
        self.kv.check_invariants()
        pool = self.kv.pool
        in_use = sum(1 for b in pool.blocks if b.ref_count > 0)
        assert in_use + pool.num_free_blocks == pool.num_blocks

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self.live:
            table = self.kv.block_ids(seq)
            assert len(table) == -(-seq.num_computed_tokens // self.BLOCK_SIZE)  # < 1 partial page wasted
            read = [self.slots[table[p // self.BLOCK_SIZE]][p % self.BLOCK_SIZE] for p in range(seq.num_computed_tokens)]
            assert read == seq.token_ids[: seq.num_computed_tokens]


TestPagesMachine = PagesMachine.TestCase
TestPagesMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
