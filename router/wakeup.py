"""`Wakeup`: how the router's tasks sleep until something changed (queue, pages, roles).

Everything runs on one asyncio loop; state changes happen between awaits, so no locks are needed.
A task takes a token *before* it looks for work, then waits on it: a `notify` in between is not lost.
"""

from __future__ import annotations

import asyncio


class Wakeup:
    """A change signal shared by the replica loops and the migration tasks."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """Something changed: wake every waiting task."""
        self._changed.set()
        self._changed = asyncio.Event()

    def token(self) -> asyncio.Event:
        """Take before checking for work; `wait(token)` then cannot miss a `notify` in between."""
        return self._changed

    async def wait(self, token: asyncio.Event | None = None, timeout: float = 0.5) -> None:
        """Sleep until `notify` (since `token` was taken) or `timeout` (which keeps loops self-healing)."""
        event = token or self._changed
        if event.is_set():
            return
        # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that races the wake-up.
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait([waiter], timeout=timeout)
        finally:
            waiter.cancel()
