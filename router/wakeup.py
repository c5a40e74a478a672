"""`Wakeup` and `Wakeups`: how the router's tasks sleep until something they wait for changed.

Everything runs on one asyncio loop; state changes happen between awaits, so no locks are needed.
A task takes a token *before* it looks for work, then waits on it: a `notify` in between is not lost.

Each replica's loop sleeps on a `Wakeup` of its own, and the migration tasks waiting for a
destination share one, so a change wakes only the tasks it can give work to:

| change                                                 | wakes                                    |
|--------------------------------------------------------|------------------------------------------|
| the queue gained requests (`queue`)                    | as many loops that found no batch as     |
|                                                        | requests wait; one of them that takes    |
|                                                        | none wakes the next (`stepped`)          |
| a replica's inbox, prefill or outbound slot (`replica`) | that replica's loop                      |
| pages or an inbound slot freed on a replica (`pages`)  | that loop and the waiting hand-offs      |
| a role, the strategy, a replica joined or died (`all`) | every loop and every waiting hand-off    |

Every wait keeps its timeout (`SAFETY_TIMEOUT_S`), so a loop still looks again now and then.
"""

from __future__ import annotations

import asyncio
import itertools

# The longest a task sleeps without a notify: it looks for work again after it (self-healing).
SAFETY_TIMEOUT_S = 0.5


class Wakeup:
    """A change signal: `notify` wakes every task waiting on it."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """Something changed: wake every waiting task."""
        self._changed.set()
        self._changed = asyncio.Event()

    def token(self) -> asyncio.Event:
        """Take before checking for work; `wait(token)` then cannot miss a `notify` in between."""
        return self._changed

    async def wait(self, token: asyncio.Event | None = None, timeout: float | None = None) -> None:
        """Sleep until `notify` (since `token` was taken) or `timeout` (`SAFETY_TIMEOUT_S` unless given)."""
        event = token or self._changed
        if event.is_set():
            return
        # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that races the wake-up.
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait([waiter], timeout=SAFETY_TIMEOUT_S if timeout is None else timeout)
        finally:
            waiter.cancel()


class Wakeups:
    """The wake-ups of one router: one per replica loop (by replica id), one for the migration tasks."""

    def __init__(self) -> None:
        self.moves = Wakeup()  # hand-offs waiting for a destination (pages, inbound slots, roles)
        self._loops: dict[int, Wakeup] = {}
        self._takers: dict[int, None] = {}  # loops whose last look at the queue found no batch, in order
        self._called: set[int] = set()  # loops the queue woke that have not ended a step since
        self._tried: set[int] = set()  # loops the queue woke since it last gained requests

    def loop(self, replica: int) -> Wakeup:
        """The wake-up of `replica`'s loop (the same one across restarts of the loop)."""
        wakeup = self._loops.get(replica)
        if wakeup is None:
            wakeup = self._loops[replica] = Wakeup()
        return wakeup

    def stepping(self, replica: int) -> None:
        """`replica`'s loop starts a step: it is no longer waiting for the queue (until `wants_batch`)."""
        self._takers.pop(replica, None)

    def wants_batch(self, replica: int) -> None:
        """`replica`'s loop found no batch it could take: wake it when the queue gains requests."""
        self._takers[replica] = None

    def queue(self, waiting: int) -> None:
        """The queue gained requests (new, re-run or retried) or lost a dead head; `waiting` requests
        are queued: wake that many of the loops waiting for a batch, oldest first (each takes one
        request at least, or hands the call on when it ends its step: `stepped`)."""
        self._tried = set()
        for replica in list(itertools.islice(self._takers, waiting)):
            self._call(replica)

    def stepped(self, replica: int, took: bool, waiting: int) -> None:
        """`replica`'s loop ended a step (`took`: it took a batch). If the queue had woken it and it
        took nothing while `waiting` requests are queued, the next loop waiting for a batch that
        the queue has not woken since it last gained requests is woken in its place."""
        if replica not in self._called:
            return
        self._called.discard(replica)
        if took or not waiting:
            return
        for other in self._takers:
            if other not in self._tried:
                self._call(other)
                return

    def _call(self, replica: int) -> None:
        self._takers.pop(replica, None)
        self._tried.add(replica)
        self._called.add(replica)
        self.replica(replica)

    def replica(self, replica: int) -> None:
        """Work arrived for `replica`'s loop (inbox, a prefill slot or an outbound slot free)."""
        wakeup = self._loops.get(replica)
        if wakeup is not None:
            wakeup.notify()

    def pages(self, replica: int) -> None:
        """Pages or an inbound slot freed on `replica`: its loop and the hand-offs waiting for a
        destination may go on."""
        self.replica(replica)
        self.moves.notify()

    def all(self) -> None:
        """Roles, the strategy or the replicas changed: wake every loop and every waiting hand-off."""
        self.moves.notify()
        for wakeup in self._loops.values():
            wakeup.notify()
        self._takers.clear()
        self._called.clear()
