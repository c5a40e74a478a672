"""`share_bounds`: contiguous shares of the regions of about equal bytes, each at least one region,
the same split for sender and receiver; shares out of range are INVALID_ARGUMENT."""

from __future__ import annotations

from itertools import pairwise

import pytest

from replica.errors import InvalidArgument
from replica.params.shares import share_bounds, share_of


def test_shares_are_contiguous_cover_every_region_and_balance_bytes() -> None:
    sizes = [4096, *([1000] * 32), 4096]  # embed, 32 layers, head
    for n in (1, 2, 3, 5):
        bounds = share_bounds(sizes, n)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
        assert all(a[1] == b[0] for a, b in pairwise(bounds))
        loads = [sum(sizes[b:e]) for b, e in bounds]
        assert max(loads) - min(loads) <= max(sizes)  # within one region of even
    assert share_bounds([100, 10, 10, 10, 100], 2) == [(0, 3), (3, 5)]
    assert share_bounds([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]  # every share holds a region


def test_a_share_out_of_range_is_invalid() -> None:
    assert share_of([5, 5, 5, 5], 1, 2) == (2, 4)
    for share, shares in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(InvalidArgument):
            share_of([5, 5, 5, 5], share, shares)
    with pytest.raises(InvalidArgument):
        share_bounds([5, 5], 3)  # more shares than regions
