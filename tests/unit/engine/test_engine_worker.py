"""EngineWorker: results and errors come back; a call past its deadline leaves nothing behind."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from replica.engine.worker import EngineWorker
from replica.errors import DeadlineExceeded, NotFound, ShuttingDown


@pytest.fixture
def worker() -> Iterator[EngineWorker]:
    w = EngineWorker("test-engine")
    yield w
    w.stop()


def test_result_and_error_propagate(worker: EngineWorker) -> None:
    assert worker.call(lambda: threading.current_thread().name, timeout=5) == "test-engine"

    def fail() -> None:
        raise NotFound("nope")

    with pytest.raises(NotFound):
        worker.call(fail, timeout=5)


def test_abandoned_running_item_is_undone(worker: EngineWorker) -> None:
    release = threading.Event()
    undone: list[int] = []
    with pytest.raises(DeadlineExceeded):
        worker.call(lambda: release.wait(5) and 42, timeout=0.05, undo=undone.append)
    release.set()
    worker.call(lambda: None, timeout=5)  # the queue is FIFO: the abandoned item finished before this
    assert undone == [42]


def test_abandoned_queued_item_never_runs(worker: EngineWorker) -> None:
    release = threading.Event()
    ran: list[str] = []
    blocker = worker.submit(lambda: release.wait(5))
    with pytest.raises(DeadlineExceeded):
        worker.call(lambda: ran.append("x"), timeout=0.05)
    release.set()
    blocker.future.result(5)
    worker.call(lambda: None, timeout=5)
    assert ran == []


def test_stopped_worker_refuses_work() -> None:
    w = EngineWorker()
    w.stop()
    assert not w.alive
    with pytest.raises(ShuttingDown):
        w.call(lambda: 1)
