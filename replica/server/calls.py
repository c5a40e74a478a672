"""`CallContext`: one call as the core sees it, whatever carried it (no grpc here).

```
 edge: deadline (CLOCK_MONOTONIC, shared by both processes) ──► CallContext(deadline)
       caller cancels / deadline passes / connection closes  ──► cancel(): `cancellation` set,
                                                                  its hooks run (a sender aborts)
       the answer went out (or the call was cancelled)      ──► finish(): `after` callbacks run
```
It replaces grpc's ServicerContext inside the replica: handlers read `remaining()`, pass
`cancellation` to waits and senders, and put work that must not delay the answer (a log line)
in `after`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from replica.cancellation import Cancellation
from replica.errors import DeadlineExceeded

log = logging.getLogger(__name__)


class CallContext:
    """A call's deadline, its cancellation and what runs once it has been answered."""

    __slots__ = ("_after", "_lock", "cancellation", "deadline")

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline  # time.monotonic() value, None without one
        self.cancellation = Cancellation()
        self._after: list[Callable[[], None]] | None = []  # None once the call finished
        self._lock = threading.Lock()

    def remaining(self) -> float | None:
        """Seconds left before the deadline (never negative); None without a deadline."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def check_started_in_time(self) -> None:
        """Refuse to start a call whose deadline passed while it travelled or queued."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlineExceeded("the call's deadline passed before the replica started it")

    def after(self, fn: Callable[[], None]) -> None:
        """Run `fn` once the call is over (answered or cancelled); at once if it is already."""
        with self._lock:
            if self._after is not None:
                self._after.append(fn)
                return
        fn()

    def cancel(self) -> None:
        """The caller is gone: set the cancellation (its hooks run), then finish."""
        self.cancellation.set()
        self.finish()

    def finish(self) -> None:
        """The call is over: run the `after` callbacks, once."""
        with self._lock:
            callbacks, self._after = self._after, None
        for callback in callbacks or ():
            try:
                callback()
            except Exception:
                log.exception("a call's after-answer callback failed")
