"""Serialising migrations between one pair of replicas (pure threading: no torch, no grpc).

Messages of one (peer, stream) pair are matched in posting order, so two migrations between the
same pair must not interleave. The sender side holds a per-peer lock for the whole migration
(`SendGates`); each migration starts with a header naming its batch. The receiver side
(`InboundTurns`) lets one Immigrate at a time read the next header from a peer: if it names that
Immigrate's batch, the reader goes on to receive the data; if it names another batch, the reader
parks the header and hands the stream to the Immigrate of that batch (which may arrive a little
later). Concurrent migrations between the same pair are thus serialised in the sender's order and
both succeed, whatever order their Migrate and Immigrate calls arrive in.

An Immigrate that gives up (deadline, cancel) before its header came leaves the stream as it is
(its header receive is withdrawn) and is remembered as abandoned: if its sender comes after all,
the next reader of that peer's stream refuses the late header (the sender fails at once) instead
of parking it for an Immigrate that will never come.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from replica.errors import PeerTimeout, PeerUnavailable
from replica.migration.plan import Header

_POLL_S = 0.2  # how often a wait for the gate looks at its caller's cancellation


class SendGates:
    """One lock per peer rank, held by the migration sending to it."""

    def __init__(self) -> None:
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def acquire(
        self, peer: int, timeout: float, cancelled: threading.Event | None = None
    ) -> Callable[[], None]:
        """Take the gate to `peer` within `timeout` s (unless `cancelled` is set first); returns the
        release function."""
        with self._guard:
            lock = self._locks.setdefault(peer, threading.Lock())
        end = time.monotonic() + max(timeout, 0.0)
        while not lock.acquire(timeout=max(min(end - time.monotonic(), _POLL_S), 0.0)):
            if cancelled is not None and cancelled.is_set():
                raise PeerUnavailable(f"the caller cancelled while another migration to rank {peer} ran")
            if time.monotonic() >= end:
                raise PeerTimeout(f"another migration to rank {peer} still runs (waited {timeout:.1f} s)")
        return lock.release


@dataclass
class _Parked:
    header: Header
    expires: float  # monotonic time after which the parked header's sender has given up


class _Turn:
    """The inbound side of one peer: who reads the stream now, and a parked header."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.reading = False  # someone owns the stream (reading a header, or receiving data)
        self.parked: _Parked | None = None


ABANDONED_KEPT = 1024  # abandoned (peer, batch) pairs remembered, the oldest forgotten first


class InboundTurns:
    """Hands the KV stream from each peer to the Immigrate whose header arrived."""

    def __init__(self, park_seconds: float) -> None:
        self._turns: dict[int, _Turn] = {}
        self._guard = threading.Lock()
        self._park_seconds = park_seconds
        self._abandoned: OrderedDict[tuple[int, int], None] = OrderedDict()

    def _turn(self, peer: int) -> _Turn:
        with self._guard:
            return self._turns.setdefault(peer, _Turn())

    def claim(
        self,
        peer: int,
        batch_id: int,
        read_header: Callable[[], Header],
        deadline: float,
        cancelled: threading.Event | None = None,
        refuse: Callable[[Header], None] | None = None,
    ) -> Header:
        """Own the stream from `peer` for `batch_id`; returns its header. Call `release` afterwards.

        `read_header` reads the next header from the stream (called with the stream owned, outside
        the lock). `deadline` is a `time.monotonic()` value; `cancelled` (the caller gave up) ends the
        wait. `refuse` fails the sender of a late header of an abandoned batch (then the next header
        is read); without it such a header is parked like any other. If the claim fails, `batch_id`
        counts as abandoned until an Immigrate of it claims again.
        """
        self._forget(peer, batch_id)
        try:
            return self._claim(peer, batch_id, read_header, deadline, cancelled, refuse)
        except BaseException:
            with self._guard:
                self._abandoned[(peer, batch_id)] = None
                while len(self._abandoned) > ABANDONED_KEPT:
                    self._abandoned.popitem(last=False)
            raise

    def _claim(
        self,
        peer: int,
        batch_id: int,
        read_header: Callable[[], Header],
        deadline: float,
        cancelled: threading.Event | None,
        refuse: Callable[[Header], None] | None,
    ) -> Header:
        turn = self._turn(peer)
        while True:
            with turn.cond:
                parked = self._wait_turn(turn, peer, batch_id, deadline, cancelled)
            if parked is not None:
                return parked  # the stream was kept owned for us
            try:
                header = read_header()
                while refuse is not None and self._late(peer, batch_id, header):
                    refuse(header)  # its Immigrate gave up: fail its sender, read on
                    header = read_header()
            except BaseException:
                self.release(peer)
                raise
            if header.batch_id == batch_id:
                return header
            with turn.cond:  # another batch's migration comes first: park it for its Immigrate
                turn.parked = _Parked(header, time.monotonic() + self._park_seconds)
                turn.cond.notify_all()

    def _late(self, peer: int, batch_id: int, header: Header) -> bool:
        """Whether `header` (read for `batch_id`) is another batch's whose Immigrate gave up."""
        return header.batch_id != batch_id and self._forget(peer, header.batch_id)

    def _forget(self, peer: int, batch_id: int) -> bool:
        """Drop `batch_id` from the abandoned ones; whether it was there."""
        with self._guard:
            if (peer, batch_id) not in self._abandoned:
                return False
            del self._abandoned[(peer, batch_id)]
            return True

    def _wait_turn(
        self, turn: _Turn, peer: int, batch_id: int, deadline: float, cancelled: threading.Event | None
    ) -> Header | None:
        """(Holding the lock) our parked header, or None once we own the stream to read the next one."""
        while True:
            self._expire(turn)
            parked = turn.parked
            if parked is not None and parked.header.batch_id == batch_id:
                turn.parked = None
                return parked.header
            if not turn.reading:
                turn.reading = True
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(f"no migration of batch {batch_id} from rank {peer} before the deadline")
            if cancelled is not None and cancelled.is_set():
                raise PeerUnavailable(f"batch {batch_id}: the caller cancelled while waiting for rank {peer}")
            turn.cond.wait(min(left, 0.2))

    def release(self, peer: int) -> None:
        """The owner is done with the stream (data received, or failed)."""
        turn = self._turn(peer)
        with turn.cond:
            turn.reading = False
            turn.cond.notify_all()

    @staticmethod
    def _expire(turn: _Turn) -> None:
        if turn.parked is not None and time.monotonic() > turn.parked.expires:
            turn.parked = None  # its Immigrate never came; its sender has failed by now
            turn.reading = False
            turn.cond.notify_all()
