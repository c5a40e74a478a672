"""`PeerLiveness`: what one rank's connections have seen of each peer, across streams and directions.

A peer that refuses connections may not be listening *yet* (peers start at different times), so a
refused connection is retried for a grace period. But a peer that closed or reset a connection
with us (any stream, either direction: its process died, its fabric closed) and now refuses is
gone: the first refusal then fails at once instead of after the grace, and whoever waits on that
peer (a migration sender holding its pages, a weight sender holding the parameter guard) is freed
now. A successful handshake with the peer, either way, clears it. Pure threading.
"""

from __future__ import annotations

import threading


class PeerLiveness:
    """Peers seen leaving (a connection closed or reset by them) since we last reached them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lost: set[int] = set()

    def lost(self, peer: int) -> None:
        """A connection with `peer` was closed or reset from its side."""
        with self._lock:
            self._lost.add(peer)

    def reached(self, peer: int) -> None:
        """A handshake with `peer` succeeded (it connected to us, or we to it)."""
        with self._lock:
            self._lost.discard(peer)

    def gone(self, peer: int) -> bool:
        """Whether `peer` left and was not reached since: a refused connection means it is gone."""
        with self._lock:
            return peer in self._lost
