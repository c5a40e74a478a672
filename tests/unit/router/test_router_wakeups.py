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
    assert woken(lambda w: w.queue(5), takers=(0, 2)) == {"0", "2"}
    assert woken(lambda w: w.queue(5)) == set()


def test_the_queue_wakes_as_many_loops_as_requests_wait_oldest_first() -> None:
    assert woken(lambda w: w.queue(1), takers=(2, 0, 1)) == {"2"}
    assert woken(lambda w: w.queue(2), takers=(2, 0, 1)) == {"2", "0"}


def test_a_loop_that_stepped_again_is_no_longer_woken_by_the_queue() -> None:
    def change(w: Wakeups) -> None:
        w.stepping(0)
        w.queue(5)
    assert woken(change, takers=(0, 1)) == {"1"}


def test_the_queue_wakes_a_taker_once_until_it_looks_again() -> None:
    def change(w: Wakeups) -> None:
        w.queue(5)
        tokens = [w.loop(rid).token() for rid in LOOPS]
        w.queue(5)
        assert not any(t.is_set() for t in tokens)
    assert woken(change, takers=(1,)) == {"1"}


def after_a_call(w: Wakeups, took: bool, waiting: int) -> set[int]:
    """The queue woke loop 0 of takers 0, 1, 2; loop 0 ends its step: which loops wake next."""
    w.queue(1)
    w.stepping(0)
    if not took:
        w.wants_batch(0)  # it looked and found nothing that fits it
    tokens = {rid: w.loop(rid).token() for rid in LOOPS}
    w.stepped(0, took, waiting)
    return {rid for rid, token in tokens.items() if token.is_set()}


def test_a_woken_loop_that_takes_nothing_wakes_the_next_waiting_loop() -> None:
    w = Wakeups()
    for rid in LOOPS:
        w.wants_batch(rid)
    assert after_a_call(w, took=False, waiting=1) == {1}


def test_a_woken_loop_that_took_a_batch_or_emptied_the_queue_wakes_nobody() -> None:
    for took, waiting in ((True, 1), (False, 0)):
        w = Wakeups()
        for rid in LOOPS:
            w.wants_batch(rid)
        assert after_a_call(w, took=took, waiting=waiting) == set()


def test_the_call_goes_round_the_waiting_loops_once_per_change_of_the_queue() -> None:
    w = Wakeups()
    for rid in LOOPS:
        w.wants_batch(rid)
    w.queue(1)
    order = [0]
    for _ in range(5):  # each loop takes nothing and looks again: the head fits none of them
        rid = order[-1]
        w.stepping(rid)
        w.wants_batch(rid)
        tokens = {r: w.loop(r).token() for r in LOOPS}
        w.stepped(rid, False, 1)
        order += [r for r, token in tokens.items() if token.is_set()]
    assert order == [0, 1, 2]  # then nobody: no loop is woken twice for the same queue
    tokens = {r: w.loop(r).token() for r in LOOPS}
    w.queue(1)  # the queue changed: the oldest waiting loop is tried again
    assert {r for r, token in tokens.items() if token.is_set()} == {0}


def test_a_step_the_queue_did_not_wake_hands_nothing_on() -> None:
    w = Wakeups()
    for rid in LOOPS:
        w.wants_batch(rid)
    tokens = {rid: w.loop(rid).token() for rid in LOOPS}
    w.stepped(0, False, 3)
    assert not any(token.is_set() for token in tokens.values())


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
