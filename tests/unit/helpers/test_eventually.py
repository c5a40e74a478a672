"""`eventually` (tests/helpers/eventually.py): first truthy value, a failure naming the last one,
exceptions only ignored when asked."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.helpers.eventually import eventually, eventually_async


def test_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert eventually(lambda: next(counter) >= 3 and "ready", 5, interval=0.001) == "ready"


def test_fails_after_the_deadline_with_the_message_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=r"pages back not met within 0.05 s \(last: 0\)"):
        eventually(lambda: 0, 0.05, message="pages back")


def test_an_exception_fails_at_once_unless_it_is_ignored() -> None:
    calls = itertools.count()

    def flaky() -> bool:
        if next(calls) < 2:
            raise ConnectionError("not up yet")
        return True

    with pytest.raises(ConnectionError):
        eventually(flaky, 5)
    calls = itertools.count()
    assert eventually(flaky, 5, interval=0.001, ignoring=(ConnectionError,))

    def down() -> bool:
        raise ConnectionError("still down")

    with pytest.raises(AssertionError, match="still down"):
        eventually(down, 0.05, ignoring=(ConnectionError,))


def test_the_async_form_awaits_an_async_condition_and_lets_the_loop_run() -> None:
    async def body() -> str:
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.02, done.set)

        async def ready() -> str | None:
            return "set" if done.is_set() else None

        return await eventually_async(ready, 5)

    assert asyncio.run(body()) == "set"
    with pytest.raises(AssertionError, match="never"):
        asyncio.run(eventually_async(lambda: False, 0.05, message="never"))
