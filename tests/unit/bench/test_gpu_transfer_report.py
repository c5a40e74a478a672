"""`pdcluster bench gpu-transfer`'s pure parts with known numbers: the regions of each leg, the bytes
each moves, the slower-rank medians, the ratios and their goals, and the options it refuses."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.bench.gpu_transfer import (
    GOAL,
    RATIOS,
    BenchGpuTransferConfig,
    kv_regions,
    layer_regions,
    leg_seconds,
    legs,
    moved_bytes,
    report,
)

SMALL = BenchGpuTransferConfig(device="cpu", kv_size="10KiB", page="4KiB", weights_size="10KiB",
                               layer="4KiB", chunk="1KiB", repeats=3)


def test_kv_pages_land_back_to_front_with_the_partial_page_left_out() -> None:
    send, recv = kv_regions(10 << 10, 4 << 10)
    assert send == [(0, 4096), (4096, 4096)]
    assert recv == [(4096, 4096), (0, 4096)]


def test_weight_regions_cover_the_buffer_with_a_shorter_last_one() -> None:
    assert layer_regions(10 << 10, 4 << 10) == [(0, 4096), (4096, 4096), (8192, 2048)]
    assert sum(n for _, n in layer_regions(10 << 10, 4 << 10)) == 10 << 10


def test_every_leg_moves_what_its_regions_add_up_to() -> None:
    sizes = moved_bytes(SMALL)
    for leg in legs(SMALL):
        assert sum(n for _, n in leg.send) == sum(n for _, n in leg.recv) == sizes[leg.name]
    assert sizes["device_copy_kv"] == sizes["kv_ipc"] == 8192
    assert sizes["device_copy_weights"] == sizes["weights_ipc"] == 10 << 10
    assert {leg for leg, _ in RATIOS.values()} | {c for _, c in RATIOS.values()} <= set(sizes)


def test_leg_time_is_the_median_of_the_slower_rank_per_repeat() -> None:
    records = [{"times": {"kv_ipc": [1.0, 5.0, 2.0]}}, {"times": {"kv_ipc": [3.0, 1.0, 1.0]}}]
    assert leg_seconds(records) == {"kv_ipc": 3.0}  # max per repeat: 3, 5, 2


def _records(leg_s: dict[str, float], copy_s: dict[str, float], ok: bool = True) -> list[dict[str, Any]]:
    times = {name: [s, s, s] for name, s in leg_s.items()}
    return [{"rank": 0, "times": times, "ok": True, "copies": copy_s, "device_name": "X"},
            {"rank": 1, "times": times, "ok": ok, "copies": {}}]


def test_ratios_divide_gbps_of_the_same_bytes_and_judge_the_goal() -> None:
    legs_s = {"kv_ipc": 1.0, "kv_staged_tcp": 2.0, "kv_host_tcp": 1.5, "weights_ipc": 1.0}
    out = report(SMALL, "cpu", _records(legs_s, {"kv": 0.5, "weights": 0.9}))
    assert out["gbps"]["kv_ipc"] == pytest.approx(8192 / 1e9)
    assert out["ratios"]["kv_ipc/device_copy"] == {"value": pytest.approx(0.5), "goal": GOAL, "met": False}
    assert out["ratios"]["kv_staged_tcp/kv_host_tcp"]["value"] == pytest.approx(0.75)
    weights = out["ratios"]["weights_ipc/device_copy"]
    assert weights == {"value": pytest.approx(0.9), "goal": GOAL, "met": True}
    assert (out["goals_met"], out["goals"], out["verified"]) == (1, 3, True)
    assert (out["device"], out["device_name"]) == ("cpu", "X")
    assert out["seconds"]["device_copy_weights"] == 0.9


def test_wrong_bytes_on_a_receiver_are_reported() -> None:
    legs_s = {"kv_ipc": 1.0, "kv_staged_tcp": 1.0, "kv_host_tcp": 1.0, "weights_ipc": 1.0}
    assert report(SMALL, "cpu", _records(legs_s, {"kv": 1.0, "weights": 1.0}, ok=False))["verified"] is False


@pytest.mark.parametrize("bad", [{"page": "2MiB", "kv_size": "1MiB"}, {"layer": "4GiB"}, {"repeats": 0},
                                 {"device": "tpu"}, {"chunk": "lots"}])
def test_options_it_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BenchGpuTransferConfig(**bad)
