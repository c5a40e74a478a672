"""Emulated link bandwidth: a pacing token bucket shared by every connection using one link.

A message of n bytes may leave only when the link would have finished serialising it: the sender
sleeps until `max(link_free, now - MAX_LAG) + n / rate`, then writes it at loopback speed. So a
chunk reaches the next rank when it would have over a real link of that rate, and chains pipeline
as on a cluster. The lag allowance absorbs the time the loopback write itself takes (otherwise every
message would add it and the emulated link would run slow), while an idle link still cannot bank
more than MAX_LAG of credit.
"""

from __future__ import annotations

import threading
import time

from transfer.core import Deadline
from transfer.errors import PeerTimeout

MAX_LAG_S = 0.02


class LinkPacer:
    """Paces the bytes of one emulated link (`gbps` gigabits per second)."""

    def __init__(self, gbps: float) -> None:
        if gbps <= 0:
            raise ValueError(f"link rate must be positive, got {gbps}")
        self.bytes_per_s = gbps * 1e9 / 8
        self._free_at = 0.0
        self._lock = threading.Lock()

    def take(self, nbytes: int, deadline: Deadline) -> None:
        """Block until `nbytes` have crossed the link; `PeerTimeout` if that is past the deadline."""
        with self._lock:
            now = time.monotonic()
            done_at = max(now - MAX_LAG_S, self._free_at) + nbytes / self.bytes_per_s
            if done_at > deadline.at:
                raise PeerTimeout(f"emulated link busy past the deadline ({nbytes} bytes)")
            self._free_at = done_at
        delay = done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
