"""`EngineWorker`: the one thread that runs engine work items, and the futures callers wait on.

A caller submits a function and waits with its deadline. If the deadline passes first, the item is
abandoned: not run at all if it had not started, or, if it was running, its `undo` runs on the
engine thread right after it finishes (e.g. drop the batch a prefill just cached), so a call that
timed out leaves nothing behind.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from replica.errors import DeadlineExceeded, ShuttingDown

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class WorkItem(Generic[T]):
    """One unit of engine work and its outcome."""

    fn: Callable[[], T]
    undo: Callable[[T], None] | None = None
    future: Future[T] = field(default_factory=Future)
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False


class EngineWorker:
    """Runs submitted functions one at a time on a dedicated thread."""

    def __init__(self, name: str = "engine") -> None:
        self._queue: queue.SimpleQueue[WorkItem[Any] | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> WorkItem[T]:
        """Queue `fn`; refused once the worker is stopping."""
        if self._stopped.is_set():
            raise ShuttingDown("the replica is shutting down")
        item: WorkItem[T] = WorkItem(fn, undo)
        self._queue.put(item)
        return item

    def call(
        self, fn: Callable[[], T], timeout: float | None = None, undo: Callable[[T], None] | None = None
    ) -> T:
        """Run `fn` on the engine thread and return its result (or raise its error) within `timeout`."""
        return self.wait(self.submit(fn, undo), timeout)

    def wait(self, item: WorkItem[T], timeout: float | None = None) -> T:
        """The result of a submitted item within `timeout` (after it, the item is abandoned)."""
        try:
            return item.future.result(timeout)
        except FutureTimeout:
            if not self.abandon(item):
                return item.future.result()
            raise DeadlineExceeded(
                f"the engine did not finish within the call's deadline ({timeout} s)"
            ) from None

    @staticmethod
    def abandon(item: WorkItem[Any]) -> bool:
        """Nobody wants the item's result any more: skip it, or undo it once it ends if it is running.

        False if it had already finished (its result stands; the caller takes it).
        """
        with item.lock:
            if item.future.done():
                return False
            item.abandoned = True
            item.future.cancel()
            return True

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running and taking work."""
        return self._thread.is_alive() and not self._stopped.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the queued items, then end the thread."""
        self._stopped.set()
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run(item)

    @staticmethod
    def _run(item: WorkItem[Any]) -> None:
        if not item.future.set_running_or_notify_cancel():
            return  # abandoned before it started: nothing to undo
        try:
            result = item.fn()
        except BaseException as exc:
            item.future.set_exception(exc)
            return
        with item.lock:
            item.future.set_result(result)
            if not item.abandoned or item.undo is None:
                return
        try:
            item.undo(result)
        except Exception:
            log.exception("undoing an abandoned work item failed")
