"""BlockManager: exact accounting; refused operations change nothing."""

from __future__ import annotations

import pytest

from replica.errors import InvalidArgument, ResourceExhausted
from replica.kv.block_manager import BlockManager, OutOfPages, PageId, PageNotOwned, pages_for


def test_allocate_and_free_keep_exact_counts() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a) | set(b)) == 8
    assert (bm.num_free, bm.num_used) == (2, 8)
    bm.free(a)
    assert bm.num_free == 5
    bm.free(b)
    assert bm.num_free == 10
    assert all(not bm.is_allocated(PageId(p)) for p in range(10))


def test_refused_allocation_allocates_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(3)
    with pytest.raises(OutOfPages) as info:
        bm.allocate(2)
    assert isinstance(info.value, ResourceExhausted)
    assert bm.num_free == 1
    with pytest.raises(OutOfPages):
        bm.allocate_many([1, 1])
    assert bm.num_free == 1


def test_allocate_many_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    lists = bm.allocate_many([1, 2, 3])
    assert [len(x) for x in lists] == [1, 2, 3]
    assert bm.num_free == 0


def test_double_free_refused_and_frees_nothing() -> None:
    bm = BlockManager(num_blocks=5, block_size=2)
    pages = bm.allocate(2)
    other = bm.allocate(1)
    bm.free(pages)
    with pytest.raises(PageNotOwned) as info:
        bm.free([other[0], pages[0]])
    assert isinstance(info.value, InvalidArgument)
    assert bm.is_allocated(other[0]) and bm.num_free == 4
    with pytest.raises(PageNotOwned):
        bm.free([other[0], other[0]])
    with pytest.raises(PageNotOwned):
        bm.free([PageId(99)])
    assert bm.num_free == 4


def test_freed_pages_are_reused() -> None:
    bm = BlockManager(num_blocks=2, block_size=1)
    first = bm.allocate(2)
    bm.free(first)
    assert sorted(bm.allocate(2)) == sorted(first)


@pytest.mark.parametrize(("tokens", "expected"), [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4)])
def test_pages_for(tokens: int, expected: int) -> None:
    assert pages_for(tokens, 4) == expected
    assert BlockManager(1, 4).pages_for(tokens) == expected


def test_bad_construction_and_negative_counts() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(1, 4).allocate(-1)
