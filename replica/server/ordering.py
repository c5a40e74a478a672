"""`CallOrder`: pipelined DecodeV2 calls reach the engine thread in the order their caller sent them.

The router keeps up to three DecodeV2 calls of one batch on the wire. The gRPC thread pool handles
them on different threads, which race to submit their work items: the later call could run its
step first and the tokens would reach the client swapped. A pipelined call therefore names itself
and the call it must follow in its metadata:

```
 x-pdcluster-call: 42     x-pdcluster-after: 41
 handler(42) ── wait until call 41 was submitted (or failed before it) ──► submit ──► mark 42 done
```

Calls without the metadata (every other client) are not ordered. A predecessor that never shows
up (its caller gave up before it arrived) stops the wait after `max_wait` seconds.

Each call id has a gate: a raw lock held until the call is submitted (waiting on it and opening it
are C-level lock operations, ~10x cheaper than a `threading.Event`); a submitted call's gate is
replaced by `None`, so a successor that comes later does not wait at all.
"""

from __future__ import annotations

import threading
from _thread import LockType
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

CALL_KEY = "x-pdcluster-call"
AFTER_KEY = "x-pdcluster-after"


def call_names(metadata: Sequence[tuple[str, Any]]) -> tuple[str | None, str | None]:
    """(this call's id, the id of the call it must follow) from a call's metadata (None: absent)."""
    call = after = None
    for key, value in metadata:
        if key == CALL_KEY:
            call = str(value)
        elif key == AFTER_KEY:
            after = str(value)
    return call, after


class CallOrder:
    """Which pipelined calls were submitted; waits for a call's predecessor."""

    def __init__(self, remembered: int = 4096, max_wait: float = 5.0) -> None:
        self._gates: dict[str, LockType | None] = {}  # call id -> its gate (a held lock), None once submitted
        self._lock = threading.Lock()
        self._remembered = remembered
        self._max_wait = max_wait

    def _add(self, call: str, gate: LockType | None) -> None:
        """Under `_lock`: remember a new call id (old ids are never waited for again)."""
        gates = self._gates
        gates[call] = gate
        while len(gates) > self._remembered:
            del gates[next(iter(gates))]

    def follow(self, after: str, timeout: float | None) -> None:
        """Wait until call `after` was submitted (or failed before it): at most `timeout` s and
        `max_wait` s."""
        with self._lock:
            if after in self._gates:
                gate = self._gates[after]
                if gate is None:
                    return
            else:
                gate = threading.Lock()
                gate.acquire()
                self._add(after, gate)
        if gate.acquire(True, self._max_wait if timeout is None else min(timeout, self._max_wait)):
            gate.release()  # open for any other call waiting on it

    def submitted(self, call: str) -> None:
        """Call `call` was submitted (or failed before it): release the call that follows it."""
        with self._lock:
            if call in self._gates:
                gate = self._gates[call]
                self._gates[call] = None
            else:
                gate = None
                self._add(call, None)
        if gate is not None:
            gate.release()

    @contextmanager
    def ordered(self, metadata: Sequence[tuple[str, str | bytes]], timeout: float | None) -> Iterator[None]:
        """Wait for the predecessor named in `metadata`; on exit, this call counts as submitted."""
        call, after = call_names(metadata)
        if after is not None:
            self.follow(after, timeout)
        try:
            yield
        finally:
            if call is not None:
                self.submitted(call)
