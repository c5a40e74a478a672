"""Region maps (logical bytes → buffer segments) and buffer registration."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer.buffers import BufferRegistry, as_byte_view
from transfer.regions import RegionMap


def test_segments_gather_across_regions_and_merge_neighbours() -> None:
    regions = RegionMap.build([(100, 10), (0, 0), (50, 10), (60, 5)])
    assert regions.total == 25
    assert regions.segments(0, 25) == [(100, 10), (50, 15)]  # pages 50.. and 60.. are adjacent
    assert regions.segments(5, 10) == [(105, 5), (50, 5)]
    assert regions.touched(0, 25) == [0, 2, 3]  # the empty region is never "touched"
    assert regions.touched(12, 0) == []


def test_negative_regions_are_rejected() -> None:
    with pytest.raises(ValueError):
        RegionMap.build([(0, -1)])


def test_registration_of_each_kind_aliases_memory() -> None:
    registry = BufferRegistry()
    arr = np.zeros(16, np.float32)
    tensor = torch.zeros(8, dtype=torch.bfloat16)
    raw = bytearray(10)
    assert registry.register("np", arr) == 64
    assert registry.register("pt", tensor) == 16
    assert registry.register("raw", raw) == 10
    registry.slices("pt", [(0, 2)], writable=True)[0][:] = bytes([0x80, 0x3F])  # bf16 1.0
    assert tensor[0].item() == 1.0
    registry.slices("np", [(4, 4)], writable=True)[0][:] = np.float32(2.5).tobytes()
    assert arr[1] == 2.5
    assert sorted(registry.names()) == ["np", "pt", "raw"]
    registry.unregister("np")
    with pytest.raises(KeyError, match="no buffer"):
        registry.view("np")


def test_bad_buffers_are_rejected() -> None:
    registry = BufferRegistry()
    registry.register("ro", b"abc")
    with pytest.raises(ValueError, match="read-only"):
        registry.slices("ro", [(0, 1)], writable=True)
    with pytest.raises(ValueError, match="outside"):
        registry.slices("ro", [(2, 2)], writable=False)
    with pytest.raises(ValueError, match="contiguous"):
        as_byte_view(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="buffer protocol"):
        as_byte_view(object())
