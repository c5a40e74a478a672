"""`eventually`: wait for a condition with a deadline, instead of sleeping and hoping.

Both return the condition's last (truthy) value and fail the test with `message` (and the last value)
when the deadline passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.01,
               message: str = "condition") -> T:
    """Poll `condition` until it is truthy (at most `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} not met within {timeout} s (last: {value!r})")
        time.sleep(interval)


async def eventually_async(condition: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.01,
                           message: str = "condition") -> T:
    """`eventually` inside an event loop (the loop runs while it waits)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} not met within {timeout} s (last: {value!r})")
        await asyncio.sleep(interval)
