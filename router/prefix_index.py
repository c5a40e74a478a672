"""The router's approximate prefix-cache index: which replica holds which page hashes.

Pure Python, no I/O. It is fed by what the router routed (a prefill replica holds a prompt's full
pages once it prefilled them, a decode replica once they migrated to it), corrected by what the
replicas say: the page hashes each call's answer reports evicted, and the whole set a replica lists
in `Info.cached_page_hashes` (when it registers, or is polled). A replica that died or restarted
holds nothing. Approximate on purpose: a wrong guess costs a prefill of pages the replica turned
out not to hold (it computes them; nothing breaks), so the index never blocks on a replica.

Memory is bounded: each replica keeps at most `max_pages` hashes, the least recently routed
dropped first (the replica evicts least-recently-used pages too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from router.types import ReplicaId

DEFAULT_MAX_PAGES = 1 << 18  # per replica: ~20 MiB of Python ints at the bound


class PrefixIndex:
    """Replica -> the page hashes it is believed to hold, each replica's set LRU-bounded."""

    def __init__(self, max_pages: int = DEFAULT_MAX_PAGES) -> None:
        if max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {max_pages}")
        self.max_pages = max_pages
        self._pages: dict[ReplicaId, OrderedDict[int, None]] = {}

    def __len__(self) -> int:
        return sum(len(p) for p in self._pages.values())

    def pages(self, replica: ReplicaId) -> int:
        """How many page hashes `replica` is believed to hold."""
        return len(self._pages.get(replica, ()))

    def add(self, replica: ReplicaId, hashes: Iterable[int]) -> None:
        """`replica` now holds these pages (it prefilled them, or they migrated to it)."""
        held = self._pages.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_pages:
            held.popitem(last=False)

    def evict(self, replica: ReplicaId, hashes: Iterable[int]) -> None:
        """`replica` reported these pages evicted."""
        held = self._pages.get(replica)
        if held is not None:
            for h in hashes:
                held.pop(h, None)

    def reset(self, replica: ReplicaId, hashes: Iterable[int] = ()) -> None:
        """Replace what `replica` holds by what it listed (its Info); no hashes: it holds nothing."""
        self._pages.pop(replica, None)
        self.add(replica, hashes)

    def drop(self, replica: ReplicaId) -> None:
        """Forget `replica` (it died or left)."""
        self._pages.pop(replica, None)

    def cached_pages(self, replica: ReplicaId, hashes: Sequence[int]) -> int:
        """The length, in pages, of the longest prefix of `hashes` that `replica` holds.

        The hashes are chained, so the first missing page ends the usable prefix.
        """
        held = self._pages.get(replica)
        if not held:
            return 0
        for n, h in enumerate(hashes):
            if h not in held:
                return n
        return len(hashes)
