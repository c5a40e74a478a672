"""The engine thread of a virtual replica: calls run one at a time, in the order they came, and each
holds the lane for its modelled seconds.

```
 submit(method, fn) ─► queue ─► fn() runs on the engine (synchronously, at its turn)
                                 its modelled seconds (the TallyClock) pass on a timer ─► result
```
No task and no lock per call: a call is a future and, while it runs, one timer. When a call's time
is over, its caller goes on first and the next call starts right after, at the same virtual instant
(as the next holder of a lock would). A call whose caller gave up before its turn is skipped (its
RPC never reached the engine); one that started runs its full time (an engine step cannot be
interrupted).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from replica.engine.sim.clock import TallyClock
from replica.errors import ReplicaError

T = TypeVar("T")

ErrorOf = Callable[[str, ReplicaError], Exception]
"""The caller's error for an engine error of one method."""


class EngineLane:
    """One replica's engine: FIFO calls on the virtual clock."""

    def __init__(self, clock: TallyClock, error_of: ErrorOf) -> None:
        self.clock = clock
        self.error_of = error_of
        self._queue: deque[tuple[str, Callable[[], Any], asyncio.Future[Any]]] = deque()
        self._busy = False

    def submit(self, method: str, fn: Callable[[], T], outcome: asyncio.Future[T] | None = None
               ) -> asyncio.Future[T]:
        """Queue `fn`; the returned future (`outcome`, when given) holds its result or error."""
        future = outcome if outcome is not None else asyncio.get_running_loop().create_future()
        self._queue.append((method, fn, future))
        if not self._busy:
            self._run()
        return future

    def _run(self) -> None:
        """Run queued calls until one takes modelled time (a timer then resumes here)."""
        while self._queue:
            method, fn, future = self._queue.popleft()
            if future.done():  # its caller gave up before its turn
                continue
            try:
                result = fn()
            except ReplicaError as exc:
                self.clock.take()
                future.set_exception(self.error_of(method, exc))
                continue
            except BaseException as exc:  # a bug: the caller sees it as it is
                self.clock.take()
                future.set_exception(exc)
                continue
            seconds = self.clock.take()
            if seconds > 0:
                self._busy = True
                asyncio.get_running_loop().call_later(seconds, self._finish, future, result)
                return
            future.set_result(result)
        self._busy = False

    def _finish(self, future: asyncio.Future[Any], result: Any) -> None:
        if not future.done():
            future.set_result(result)
        asyncio.get_running_loop().call_soon(self._run)  # after the caller's continuation
