"""Contiguous shares of the weight buffer's regions, so several sources can each send one part of
one receiver's weights at once (a host copy striped across the nodes holding it).

```
 share_bounds([region bytes…], n) ─► n ranges [begin, end) of region indices, about equal bytes each
```
Sender and receiver compute the same split from the same layout. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from replica.errors import InvalidArgument


def share_bounds(sizes: Sequence[int], shares: int) -> list[tuple[int, int]]:
    """[begin, end) region indices of `shares` contiguous shares of about equal bytes, in order; each
    share holds at least one region (INVALID_ARGUMENT when there are fewer regions than shares)."""
    if shares < 1 or shares > len(sizes):
        raise InvalidArgument(f"{shares} shares of {len(sizes)} regions: need 1 ≤ shares ≤ regions")
    total, bounds, begin, done = sum(sizes), [], 0, 0
    for k in range(1, shares):
        target = total * k / shares
        end = begin + 1  # at least one region in this share
        done += sizes[begin]
        while end < len(sizes) - (shares - k) and done + sizes[end] / 2 <= target:
            done += sizes[end]
            end += 1
        bounds.append((begin, end))
        begin = end
    bounds.append((begin, len(sizes)))
    return bounds


def share_of(sizes: Sequence[int], share: int, shares: int) -> tuple[int, int]:
    """The region range of share `share` (0-based) of `shares` (INVALID_ARGUMENT outside them)."""
    if not 0 <= share < shares:
        raise InvalidArgument(f"share {share} is not one of {shares}")
    return share_bounds(sizes, shares)[share]
