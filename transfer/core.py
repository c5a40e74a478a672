"""Small shared types: ranks, streams, deadlines, segments and the completion handle."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

from transfer.errors import PeerTimeout, TransferError

Rank = NewType("Rank", int)
"""A process's global rank in the rank table (crosses processes)."""

StreamId = NewType("StreamId", int)
"""A stream number; messages of one (peer, stream) pair are matched in posting order."""

Segment = tuple[int, int]
"""(offset, length) in bytes inside a registered buffer."""

Segments = Sequence[Segment]

# Control streams (collective completion confirmations) live in the negative stream numbers, so they
# never collide with data streams and never queue behind data.
CONTROL_BASE = -1


class Stream(enum.IntEnum):
    """The named streams; any other non-negative int is a valid stream id too."""

    ACTIVATION = 0
    KV = 1
    PARAMS = 2
    KV_HAVE = 3  # a KV migration's receiver to its sender: the pages it holds already (replica/migration)


def control_stream(stream: int) -> StreamId:
    """The control stream that carries completion confirmations for data stream `stream`.

    Confirmation records of one (pair of ranks, stream) are matched in order, so two collectives
    between the same ranks must not overlap on one stream, in either direction: give concurrent
    transfers (say, p2p both ways) different streams.
    """
    if stream < 0:
        raise ValueError(f"data streams are non-negative, got {stream}")
    return StreamId(CONTROL_BASE - stream)


@dataclass(frozen=True)
class Deadline:
    """An absolute point in `time.monotonic()` time; every wait in the transfer layer has one."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline `seconds` from now."""
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self.at


def total_length(segments: Segments) -> int:
    """Sum of the segment lengths."""
    return sum(length for _, length in segments)


class Handle:
    """Completion of one posted send, receive or connect.

    Fabric threads call `_complete` / `_fail` exactly once; callers `wait` with a deadline or
    register a callback (called on the fabric's thread, so it must be quick and must not block).
    """

    __slots__ = ("_callbacks", "_error", "_event", "_lock", "_on_timeout", "description", "nbytes")

    def __init__(self, nbytes: int, description: str, on_timeout: Callable[[], None] | None = None) -> None:
        self.nbytes = nbytes
        self.description = description
        self._on_timeout = on_timeout  # the fabric resets the channel: a late message would misalign it
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: TransferError | None = None
        self._callbacks: list[Callable[[Handle], None]] = []

    def done(self) -> bool:
        """Whether the operation finished (successfully or not)."""
        return self._event.is_set()

    @property
    def error(self) -> TransferError | None:
        """The failure, if the operation failed."""
        return self._error

    def wait(self, deadline: Deadline) -> None:
        """Block until done; raise its error, or `PeerTimeout` when the deadline passes first."""
        if not self._event.wait(deadline.remaining()):
            error = PeerTimeout(f"{self.description}: deadline passed")
            if self._on_timeout is not None:
                self._on_timeout()
            self._fail(error)
            raise error
        if self._error is not None:
            raise self._error

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call `callback(handle)` when done (immediately if already done)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def _complete(self) -> None:
        self._finish(None)

    def _fail(self, error: TransferError) -> None:
        self._finish(error)

    def _finish(self, error: TransferError | None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


def all_of(handles: list[Handle], description: str) -> Handle:
    """A handle done when every one of `handles` is; it fails with the first failure."""
    joined = Handle(0, description)
    remaining = [len(handles)]
    lock = threading.Lock()

    def one_done(handle: Handle) -> None:
        if handle.error is not None:
            joined._fail(handle.error)
            return
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            joined._complete()

    for handle in handles:
        handle.add_done_callback(one_done)
    return joined
