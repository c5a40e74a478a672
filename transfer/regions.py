"""Mapping a plan's logical byte space onto one rank's regions of a buffer.

A caller describes its data as regions `(offset, length)` of a registered buffer, in logical order.
Logical byte `x` lives in the region whose cumulative range holds it. `RegionMap` turns a logical
range into buffer segments (gather/scatter lists) and tells which regions a range touches.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.core import Segment


@dataclass(frozen=True)
class RegionMap:
    """The caller's regions with their logical starts."""

    regions: tuple[Segment, ...]
    starts: tuple[int, ...]  # logical start of each region
    total: int

    @classmethod
    def build(cls, regions: Sequence[Segment]) -> RegionMap:
        """Index `regions` (offset, length) in the given order."""
        starts: list[int] = []
        position = 0
        for offset, length in regions:
            if offset < 0 or length < 0:
                raise ValueError(f"bad region ({offset}, {length})")
            starts.append(position)
            position += length
        return cls(tuple((int(o), int(n)) for o, n in regions), tuple(starts), position)

    def lengths(self) -> list[int]:
        """Region lengths, in order."""
        return [length for _, length in self.regions]

    def touched(self, start: int, length: int) -> list[int]:
        """Indices of the non-empty regions overlapping logical `[start, start + length)`."""
        if length <= 0:
            return []
        first = bisect.bisect_right(self.starts, start) - 1
        last = bisect.bisect_left(self.starts, start + length) - 1
        return [i for i in range(max(first, 0), last + 1) if self.regions[i][1]]

    def segments(self, start: int, length: int) -> list[Segment]:
        """Buffer segments holding logical `[start, start + length)`, adjacent ones merged."""
        out: list[Segment] = []
        end = start + length
        for index in self.touched(start, length):
            offset, size = self.regions[index]
            lo = max(start, self.starts[index])
            hi = min(end, self.starts[index] + size)
            if hi <= lo:
                continue
            seg_offset = offset + lo - self.starts[index]
            if out and out[-1][0] + out[-1][1] == seg_offset:
                out[-1] = (out[-1][0], out[-1][1] + hi - lo)  # contiguous pages: one iovec
            else:
                out.append((seg_offset, hi - lo))
        return out
