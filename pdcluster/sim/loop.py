"""An asyncio event loop on a virtual clock: time jumps to the next timer instead of passing.

```
 asyncio's _run_once:  timeout = next timer - loop.time()  ─► selector.select(timeout)
 here:                 select(timeout) advances the clock by `timeout` and returns at once
                       (nothing real is ever waited for), so the timer is due immediately
```
Everything the router's core awaits — `asyncio.sleep`, `wait_for`, `Event.wait` with a timeout, the
simulated replicas' step times — runs unchanged, as fast as the CPU goes. Nothing may block on real
I/O or threads: a loop with no timer and nothing ready is stuck for good (`VirtualTimeStuck`).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualTimeStuck(RuntimeError):
    """Every task waits for something no timer will bring: the simulation cannot go on."""


class VirtualClock:
    """Seconds of virtual time since the start."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        if seconds > 0:
            self.now += seconds


class _Selector(selectors.SelectSelector):
    """Registers like a real selector (the loop's self-pipe), never waits: it advances the clock."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise VirtualTimeStuck("no timer is due and nothing is ready: every task waits forever")
        self.clock.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """`asyncio.SelectorEventLoop` whose `time()` is a `VirtualClock` that jumps to the next timer."""

    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        super().__init__(_Selector(self.clock))

    def time(self) -> float:
        """Virtual seconds."""
        return self.clock.now


def run_virtual(main: Coroutine[Any, Any, T], clock: VirtualClock | None = None) -> T:
    """Run `main` to completion in virtual time."""
    loop = VirtualTimeLoop(clock)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
