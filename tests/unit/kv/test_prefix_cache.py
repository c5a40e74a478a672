"""The block manager's prefix cache: hashes, shared holds, LRU eviction, exact counts."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replica.kv.block_manager import BlockManager, OutOfPages, PageId, PageNotOwned
from replica.kv.page_hash import page_hash, page_hashes


def test_page_hash_is_the_protos_definition() -> None:
    data = (7).to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in (1, 2, 70000))
    expected = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert page_hash(7, [1, 2, 70000]) == expected
    digest = hashlib.blake2b(struct.pack("<QI", 0, 5), digest_size=8).digest()
    assert struct.pack("<Q", page_hash(0, [5])) == digest


def test_page_hashes_chain_full_pages_only() -> None:
    tokens = list(range(10))
    hashes = page_hashes(tokens, 4)
    assert hashes == [page_hash(0, [0, 1, 2, 3]), page_hash(hashes[0], [4, 5, 6, 7])]  # 8, 9: partial
    assert page_hashes(tokens, 4, start=1, parent=hashes[0]) == hashes[1:]
    assert page_hashes([9, 9, 9, 9], 4) != page_hashes(tokens[:4], 4)
    assert page_hashes(tokens[:3], 4) == []


def test_released_hashed_pages_are_cached_and_shared() -> None:
    bm = BlockManager(8, 4)
    pages = bm.allocate(3)
    assert bm.register(pages[0], 11) and bm.register(pages[1], 22)
    bm.free(pages)
    assert (bm.num_free, bm.num_cached, bm.num_used) == (8, 2, 0)
    shared = bm.lookup([11, 22, 33])
    assert shared == pages[:2]
    [got] = bm.allocate_many([1], shared=[shared])
    assert got[:2] == pages[:2] and (bm.num_cached, bm.num_used) == (0, 3)
    [again] = bm.allocate_many([2], shared=[bm.lookup([11])])
    assert again[0] == pages[0] and bm.refs(pages[0]) == 2 and bm.num_used == 5
    bm.free(got)
    bm.free(again)
    assert (bm.num_free, bm.num_cached) == (8, 2)
    bm.check()


def test_eviction_only_when_needed_lru_and_reported_once() -> None:
    bm = BlockManager(4, 2)
    first, second = bm.allocate(1), bm.allocate(1)
    bm.register(first[0], 1)
    bm.register(second[0], 2)
    bm.free(first)
    bm.free(second)  # first released first: evicted first
    assert bm.take_evicted() == []
    bm.allocate(2)  # the two free pages: nothing evicted
    assert bm.take_evicted() == [] and bm.num_cached == 2
    bm.allocate(1)
    assert bm.take_evicted() == [1] and bm.lookup([1]) == [] and bm.lookup([2]) == second
    assert bm.take_evicted() == []
    bm.check()


def test_refusals_change_nothing() -> None:
    bm = BlockManager(4, 2)
    pages = bm.allocate(2)
    bm.register(pages[0], 5)
    bm.free(pages)
    with pytest.raises(OutOfPages):  # the cached page counts once: revived, it is no longer available
        bm.allocate_many([4], shared=[bm.lookup([5])])
    assert (bm.num_free, bm.num_cached) == (4, 1)
    with pytest.raises(PageNotOwned):
        bm.allocate_many([0], shared=[[PageId(3)]])  # never registered
    held = bm.allocate_many([0, 0], shared=[bm.lookup([5]), bm.lookup([5])])
    with pytest.raises(PageNotOwned):
        bm.free(held[0] * 3)  # held twice, listed three times
    assert bm.refs(pages[0]) == 2
    with pytest.raises(PageNotOwned):
        bm.register(PageId(3), 9)  # not held
    bm.free(held[0] + held[1])
    assert bm.num_cached == 1
    bm.check()


def test_a_hash_kept_elsewhere_is_not_registered_twice() -> None:
    bm = BlockManager(4, 2)
    a, b = bm.allocate(1), bm.allocate(1)
    assert bm.register(a[0], 7) and not bm.register(b[0], 7)
    assert bm.register(a[0], 7) and not bm.register(a[0], 8)  # a held page keeps its name
    bm.free(a + b)
    assert (bm.num_cached, bm.lookup([7])) == (1, a)
    assert sorted(bm.cached_hashes()) == [7]


def test_share_holds_held_pages_once_more() -> None:
    bm = BlockManager(4, 2)
    pages = bm.allocate(2)
    bm.share(pages[:1])
    assert bm.refs(pages[0]) == 2 and bm.num_used == 2
    with pytest.raises(PageNotOwned):
        bm.share([pages[1], PageId(3)])  # page 3 is free: nothing shared
    assert bm.refs(pages[1]) == 1
    bm.free(pages + pages[:1])
    assert bm.num_free == 4
    bm.check()


def test_drop_cache_forgets_every_hash() -> None:
    bm = BlockManager(4, 2)
    held, cached = bm.allocate(1), bm.allocate(1)
    bm.register(held[0], 1)
    bm.register(cached[0], 2)
    bm.free(cached)
    bm.drop_cache()
    assert sorted(bm.take_evicted()) == [1, 2] and bm.lookup([1]) == bm.lookup([2]) == []
    assert (bm.num_free, bm.num_cached, bm.num_used) == (3, 0, 1)
    bm.free(held)
    assert (bm.num_free, bm.num_cached) == (4, 0)
    bm.check()


def test_cache_off_keeps_nothing() -> None:
    bm = BlockManager(4, 2, prefix_cache=False)
    pages = bm.allocate(2)
    assert not bm.register(pages[0], 1)
    bm.free(pages)
    assert (bm.num_free, bm.num_cached, bm.lookup([1]), bm.cached_hashes()) == (4, 0, [], [])


class Accounting(RuleBasedStateMachine):
    """Random allocate / share / register / free: the three states always add up."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(6, 2)
        self.holds: list[list[PageId]] = []
        self.model_refs = [0] * 6

    @rule(n=st.integers(0, 7), prefix=st.lists(st.integers(0, 5), max_size=3))
    def allocate(self, n: int, prefix: list[int]) -> None:
        shared = self.bm.lookup(prefix)
        before = (self.bm.num_free, self.bm.num_cached)
        try:
            [pages] = self.bm.allocate_many([n], shared=[shared])
        except OutOfPages:
            assert (self.bm.num_free, self.bm.num_cached) == before
            return
        for p in pages:
            self.model_refs[p] += 1
        self.holds.append(pages)

    @precondition(lambda self: self.holds)
    @rule(i=st.integers(0, 100), digest=st.integers(0, 5), j=st.integers(0, 100))
    def register(self, i: int, digest: int, j: int) -> None:
        pages = self.holds[i % len(self.holds)]
        if pages:
            self.bm.register(pages[j % len(pages)], digest)

    @precondition(lambda self: self.holds)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        pages = self.holds.pop(i % len(self.holds))
        self.bm.free(pages)
        for p in pages:
            self.model_refs[p] -= 1

    @invariant()
    def counts_add_up(self) -> None:
        self.bm.check()
        assert self.bm.num_used == sum(1 for r in self.model_refs if r)
        assert all(self.bm.refs(PageId(p)) == r for p, r in enumerate(self.model_refs))


TestAccounting = Accounting.TestCase
TestAccounting.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
