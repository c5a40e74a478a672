"""`HostCache`: the node's host-memory copies of models' weights, at most `capacity` bytes, least
recently used evicted first (ServerlessLLM's host cache; `--host-cache-bytes`).

```
 put(name, copy, nbytes) ─► too big for the capacity? not kept (False)
                          ─► else evict least recently used copies until it fits, keep it (True)
 get(name)               ─► the copy (now the most recently used) or None: a miss
```
Capacity 0 is unlimited. Pure Python: a copy is whatever the weight I/O made (a tensor, bytes).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class HostCache:
    """Named weight copies in host memory under a byte capacity, LRU."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"host cache capacity must be >= 0 bytes (0 = unlimited), got {capacity}")
        self.capacity = capacity
        self._copies: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.evictions = 0

    @property
    def used(self) -> int:
        """Bytes held."""
        return sum(n for _, n in self._copies.values())

    def names(self) -> list[str]:
        """Held models, least recently used first."""
        return list(self._copies)

    def nbytes(self, name: str) -> int:
        """Bytes of `name`'s copy (0: none held)."""
        entry = self._copies.get(name)
        return entry[1] if entry is not None else 0

    def fits(self, nbytes: int) -> bool:
        """A copy of `nbytes` can be kept at all."""
        return self.capacity == 0 or nbytes <= self.capacity

    def peek(self, name: str) -> Any:
        """The copy of `name`, or None (the LRU order is left as it is)."""
        entry = self._copies.get(name)
        return entry[0] if entry is not None else None

    def get(self, name: str) -> Any:
        """The copy of `name` (now the most recently used), or None: a miss."""
        if name not in self._copies:
            return None
        self._copies.move_to_end(name)
        return self._copies[name][0]

    def put(self, name: str, copy: Any, nbytes: int) -> bool:
        """Keep `copy` as `name`'s, evicting the least recently used others until it fits; False
        (nothing kept, nothing evicted) when it is larger than the whole capacity."""
        if not self.fits(nbytes):
            return False
        self._copies.pop(name, None)
        while self.capacity and self._copies and self.used + nbytes > self.capacity:
            self._copies.popitem(last=False)
            self.evictions += 1
        self._copies[name] = (copy, nbytes)
        return True
