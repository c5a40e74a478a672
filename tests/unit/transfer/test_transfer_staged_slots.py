"""Staging slots of one lane: reused, grown to the message, at most `depth`, within the budget
except the one slot that keeps an idle lane moving."""

from __future__ import annotations

from transfer.staged.device import HostSlot
from transfer.staged.slots import Slot, SlotPool, StagingBudget


def _pool(depth: int = 2, max_bytes: int = 1 << 20) -> tuple[SlotPool, list[int], list[str]]:
    made: list[int] = []
    installed: list[str] = []

    def allocate(nbytes: int) -> HostSlot:
        made.append(nbytes)
        return HostSlot(memoryview(bytearray(nbytes)), None)

    def install(slot: Slot) -> None:
        installed.append(slot.name)

    return SlotPool("lane", depth, StagingBudget(max_bytes), allocate, install), made, installed


def test_slots_are_recycled_not_reallocated() -> None:
    pool, made, installed = _pool()
    for _ in range(100):
        a, b = pool.acquire(1000), pool.acquire(1000)
        assert a is not None and b is not None and a is not b
        assert pool.acquire(10) is None  # depth 2: both in flight
        pool.release(a)
        pool.release(b)
    assert made == [1000, 1000] and installed == ["lane:0", "lane:1"]
    assert pool.allocated() == pool.budget.allocated == 2000


def test_a_bigger_message_grows_a_free_slot_and_a_smaller_one_takes_the_smallest_fit() -> None:
    pool, made, _ = _pool()
    small = pool.acquire(100)
    assert small is not None
    pool.release(small)
    grown = pool.acquire(5000)
    assert grown is small and grown.capacity == 5000 and made == [100, 5000]
    other = pool.acquire(50)
    assert other is not None and other is not grown and other.capacity == 50
    pool.release(grown)
    pool.release(other)
    assert pool.acquire(40) is other
    assert pool.budget.allocated == 5050


def test_the_budget_bounds_extra_slots_but_never_stops_an_idle_lane() -> None:
    pool, _, _ = _pool(depth=4, max_bytes=1500)
    first = pool.acquire(1000)
    assert first is not None
    assert pool.acquire(1000) is None  # over budget while one is in use: wait for it
    pool.release(first)
    big = pool.acquire(4000)  # nothing in use: the lane may always go on
    assert big is not None and big.capacity == 4000
