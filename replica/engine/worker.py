"""`EngineWorker`: the one thread that runs engine work items, and the futures callers wait on.

A caller submits a function and waits with its deadline. If the deadline passes first, the item is
abandoned: not run at all if it had not started, or, if it was running, its `undo` runs on the
engine thread right after it finishes (e.g. drop the batch a prefill just cached), so a call that
timed out leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
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


# Reads one message from an attached socket on the engine thread; returns the item to run now (or None).
SocketReader = Callable[[], "WorkItem[Any] | None"]


class EngineWorker:
    """Runs submitted functions one at a time on a dedicated thread.

    Besides its queue, the thread can serve one attached socket (`attach`): when the socket is
    readable and the queue is empty, the thread reads a message itself and runs the item it makes,
    so a call arriving over the socket wakes no other thread of this process (replica/server/lanes.py).
    """

    def __init__(self, name: str = "engine") -> None:
        self._queue: queue.SimpleQueue[WorkItem[Any] | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._source: tuple[socket.socket, SocketReader] | None = None
        self._wake_r, self._wake_w = os.pipe()  # wakes the thread out of select() for queued items
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> WorkItem[T]:
        """Queue `fn`; refused once the worker is stopping."""
        if self._stopped.is_set():
            raise ShuttingDown("the replica is shutting down")
        item: WorkItem[T] = WorkItem(fn, undo)
        self._put(item)
        return item

    def _put(self, item: WorkItem[Any] | None) -> None:
        self._queue.put(item)
        if self._source is not None:  # the thread may be in select(): poke it
            with contextlib.suppress(BlockingIOError):  # a full pipe is readable already
                os.write(self._wake_w, b"\0")

    def attach(self, sock: socket.socket, reader: SocketReader) -> None:
        """Serve `sock` too: `reader` runs on the engine thread whenever it is readable."""
        self._source = (sock, reader)
        self._queue.put(WorkItem(lambda: None))  # the thread may be blocked on the queue: rescan

    def detach(self) -> None:
        """Stop serving the attached socket (call on the engine thread, e.g. from the reader at EOF)."""
        self._source = None

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
        self._put(None)
        self._thread.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _loop(self) -> None:
        while (item := self._next()) is not None:
            self._run(item)

    def _next(self) -> WorkItem[Any] | None:
        """The next item: queued ones first, else one read from the attached socket (None = stop)."""
        while True:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            source = self._source
            if source is None:
                return self._queue.get()
            sock, reader = source
            fd = sock.fileno()
            ready = select.select([self._wake_r, fd], [], [])[0]
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            if fd in ready:
                try:
                    item = reader()
                except Exception:
                    log.exception("reading a call from the attached socket failed")
                    continue
                if item is not None:
                    return item

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
