"""`CallOrder` (replica/server/ordering.py): a pipelined call is submitted after the call it names."""

from __future__ import annotations

import threading
import time

from replica.server.ordering import AFTER_KEY, CALL_KEY, CallOrder


def test_a_call_waits_for_the_call_it_follows_even_when_it_arrives_first() -> None:
    order, submitted = CallOrder(), []

    def handle(call: str, after: str | None) -> None:
        meta = [(CALL_KEY, call)] + ([(AFTER_KEY, after)] if after else [])
        with order.ordered(meta, timeout=5.0):
            submitted.append(call)

    second = threading.Thread(target=handle, args=("a-2", "a-1"))
    second.start()  # arrives first: must wait for a-1
    time.sleep(0.05)
    assert submitted == []
    handle("a-1", None)
    second.join(5.0)
    assert submitted == ["a-1", "a-2"]


def test_a_failed_predecessor_still_releases_its_successor_and_plain_calls_never_wait() -> None:
    order = CallOrder(max_wait=5.0)
    try:
        with order.ordered([(CALL_KEY, "b-1")], timeout=None):
            raise ValueError("refused before it reached the engine")
    except ValueError:
        pass
    start = time.monotonic()
    with order.ordered([(CALL_KEY, "b-2"), (AFTER_KEY, "b-1")], timeout=None):
        pass
    with order.ordered([], timeout=None):
        pass
    assert time.monotonic() - start < 1.0


def test_a_predecessor_that_never_comes_stops_the_wait_at_the_limit() -> None:
    order = CallOrder(max_wait=0.1)
    start = time.monotonic()
    with order.ordered([(CALL_KEY, "c-2"), (AFTER_KEY, "c-1")], timeout=None):
        pass
    assert 0.05 < time.monotonic() - start < 2.0
