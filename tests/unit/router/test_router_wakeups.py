"""Who each change wakes (`router.wakeup.Wakeups`): a replica's loop only on the changes that give it
work, the hand-offs waiting for a destination on pages and roles, everybody on roles; and every
wait still ends at its safety timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from router import wakeup
from router.wakeup import Wakeup, Wakeups

LOOPS = (0, 1, 2)


def woken(change: Callable[[Wakeups], None], takers: tuple[int, ...] = ()) -> set[str]:
    """The tasks `change` wakes, among three idle loops (`takers` last found no batch) and the
    hand-offs' wake-up."""
    w = Wakeups()
    tokens = {str(rid): w.loop(rid).token() for rid in LOOPS}
    for rid in takers:
        w.wants_batch(rid)
    tokens["moves"] = w.moves.token()
    change(w)
    return {name for name, token in tokens.items() if token.is_set()}


def test_the_queue_wakes_only_the_loops_that_found_no_batch() -> None:
    assert woken(Wakeups.queue, takers=(0, 2)) == {"0", "2"}
    assert woken(Wakeups.queue) == set()


def test_a_loop_that_stepped_again_is_no_longer_woken_by_the_queue() -> None:
    def change(w: Wakeups) -> None:
        w.stepping(0)
        w.queue()
    assert woken(change, takers=(0, 1)) == {"1"}


def test_the_queue_wakes_a_taker_once_until_it_looks_again() -> None:
    def change(w: Wakeups) -> None:
        w.queue()
        tokens = [w.loop(rid).token() for rid in LOOPS]
        w.queue()
        assert not any(t.is_set() for t in tokens)
    assert woken(change, takers=(1,)) == {"1"}


def test_work_for_a_replica_wakes_its_loop_only() -> None:
    assert woken(lambda w: w.replica(1), takers=(0,)) == {"1"}


def test_pages_freed_wake_the_replicas_loop_and_the_waiting_hand_offs() -> None:
    assert woken(lambda w: w.pages(2)) == {"2", "moves"}


def test_a_change_of_roles_wakes_everybody() -> None:
    assert woken(Wakeups.all, takers=(0,)) == {"0", "1", "2", "moves"}


def test_a_replica_without_a_loop_yet_is_no_error() -> None:
    assert woken(lambda w: w.replica(7)) == set()


def test_a_loop_keeps_its_wakeup_across_restarts() -> None:
    w = Wakeups()
    assert w.loop(3) is w.loop(3)


def test_a_notify_after_the_token_was_taken_is_not_lost() -> None:
    async def body() -> None:
        w = Wakeup()
        token = w.token()
        w.notify()
        await asyncio.wait_for(w.wait(token, timeout=30), 1)
    asyncio.run(body())


def test_a_wait_without_notify_ends_at_the_safety_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wakeup, "SAFETY_TIMEOUT_S", 0.01)

    async def body() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.wait_for(Wakeup().wait(), 1)
        assert loop.time() - start >= 0.005
    asyncio.run(body())
