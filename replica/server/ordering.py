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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

CALL_KEY = "x-pdcluster-call"
AFTER_KEY = "x-pdcluster-after"


class CallOrder:
    """Which pipelined calls were submitted; waits for a call's predecessor."""

    def __init__(self, remembered: int = 4096, max_wait: float = 5.0) -> None:
        self._events: OrderedDict[str, threading.Event] = OrderedDict()
        self._lock = threading.Lock()
        self._remembered = remembered
        self._max_wait = max_wait

    def _event(self, call: str) -> threading.Event:
        with self._lock:
            event = self._events.get(call)
            if event is None:
                event = self._events[call] = threading.Event()
                while len(self._events) > self._remembered:  # old ids are never waited for again
                    self._events.popitem(last=False)
            return event

    @contextmanager
    def ordered(self, metadata: Sequence[tuple[str, str | bytes]], timeout: float | None) -> Iterator[None]:
        """Wait for the predecessor named in `metadata`; on exit, this call counts as submitted."""
        found = {key: value for key, value in metadata if key in (CALL_KEY, AFTER_KEY)}
        call, after = found.get(CALL_KEY), found.get(AFTER_KEY)
        if after is not None:
            limit = self._max_wait if timeout is None else min(timeout, self._max_wait)
            self._event(str(after)).wait(limit)
        try:
            yield
        finally:
            if call is not None:
                self._event(str(call)).set()
