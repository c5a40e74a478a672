"""`Cancellation`: set once when a caller gives up; waits poll it, senders hook it.

A `threading.Event` (waits keep calling `is_set` / `wait` on it) that also runs hooks when it is
set, so a side blocked in a transfer (a migration or weight sender waiting for its peer to
connect or to acknowledge) can abort that transfer at once instead of noticing at its deadline.
Pure threading: no grpc, no torch.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class Cancellation(threading.Event):
    """An event set when the caller is gone; `hook(fn)` runs `fn` then (at once if already set)."""

    def __init__(self) -> None:
        super().__init__()
        self._hooks: dict[int, Callable[[], None]] = {}
        self._hooks_lock = threading.Lock()
        self._ids = itertools.count()

    def set(self) -> None:
        """Mark the caller gone and run every hook, once."""
        with self._hooks_lock:
            if self.is_set():
                return
            super().set()
            hooks, self._hooks = list(self._hooks.values()), {}
        for hook in hooks:
            try:
                hook()
            except Exception:
                log.exception("a cancellation hook failed")

    def hook(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Run `fn` when the caller gives up (now, if it has); returns the function that unhooks it."""
        with self._hooks_lock:
            if not self.is_set():
                key = next(self._ids)
                self._hooks[key] = fn
                return lambda: self._unhook(key)
        fn()
        return lambda: None

    def _unhook(self, key: int) -> None:
        with self._hooks_lock:
            self._hooks.pop(key, None)


@contextmanager
def aborting(cancelled: threading.Event | None, abort: Callable[[], None]) -> Iterator[None]:
    """While the block runs, a caller giving up (`cancelled`, a `Cancellation`) calls `abort`."""
    unhook = cancelled.hook(abort) if isinstance(cancelled, Cancellation) else None
    try:
        yield
    finally:
        if unhook is not None:
            unhook()
