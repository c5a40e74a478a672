"""`eventually`: wait for a condition with a deadline, instead of sleeping and hoping.

    eventually(lambda: replica.free_blocks() == total, 10, message="pages back")
    await eventually_async(lambda: fake.calls.count("DecodeV2") >= 3)
    await eventually_async(pages_all_free)          # an async condition is awaited each time
    eventually(lambda: stub.Info(req), 30, ignoring=(grpc.RpcError,))   # not up yet: try again

Both return the condition's first truthy value and fail the test with `message` (and the last
value) when the deadline passes; the last try is made after the deadline, so a condition that
holds by then never fails. A condition that raises fails the test at once, unless the exception
is one of `ignoring` (then it counts as "not yet", and is the last value if time runs out).
`message` may be a function, called at the failure (to name what the condition last saw).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")
Errors = tuple[type[BaseException], ...]
Message = str | Callable[[], str]


class Deadline:
    """When a wait gives up, and the failure it reports."""

    def __init__(self, timeout: float, message: Message) -> None:
        self.timeout, self.message = timeout, message
        self.end = time.monotonic() + timeout

    def check(self, last: object) -> None:
        """Fail the test once the deadline has passed (`last`: the condition's last value)."""
        if time.monotonic() > self.end:
            message = self.message if isinstance(self.message, str) else self.message()
            raise AssertionError(f"{message} not met within {self.timeout} s (last: {last!r})")


def eventually(condition: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.01,
               message: Message = "condition", ignoring: Errors = ()) -> T:
    """Poll `condition` until it is truthy (at most `timeout` seconds)."""
    deadline = Deadline(timeout, message)
    while True:
        value: Any
        try:
            value = condition()
        except ignoring as exc:
            value = exc
        else:
            if value:
                return value
        deadline.check(value)
        time.sleep(interval)


@overload
async def eventually_async(condition: Callable[[], Awaitable[T | None]], timeout: float = ...,
                           interval: float = ..., message: Message = ..., ignoring: Errors = ...) -> T: ...


@overload
async def eventually_async(condition: Callable[[], T | None], timeout: float = ..., interval: float = ...,
                           message: Message = ..., ignoring: Errors = ...) -> T: ...


async def eventually_async(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01,
                           message: Message = "condition", ignoring: Errors = ()) -> Any:
    """`eventually` inside an event loop (the loop runs while it waits); `condition` may be async."""
    deadline = Deadline(timeout, message)
    while True:
        try:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
        except ignoring as exc:
            value = exc
        else:
            if value:
                return value
        deadline.check(value)
        await asyncio.sleep(interval)
