"""`pdcluster bench gpu-transfer --device cpu`: a whole small run through the CPU doubles (the ipc
fabric's shared-memory backend; host memory on the staged and tcp legs), two processes: every
receiver got the right bytes and the JSON report has every leg, copy and ratio."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.bench.gpu_transfer import RATIOS, BenchGpuTransferConfig, run


def test_a_small_cpu_run_writes_the_whole_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_transfer.json"
    config = BenchGpuTransferConfig(device="cpu", kv_size="2MiB", page="16KiB", weights_size="3MiB",
                                    layer="1MiB", chunk="256KiB", repeats=2, timeout=60, json_out=out)
    assert run(config) == 0
    report = json.loads(out.read_text())
    assert report["verified"] is True and report["device"] == "cpu"
    legs = {"kv_ipc", "kv_staged_tcp", "kv_host_tcp", "weights_ipc", "device_copy_kv", "device_copy_weights"}
    assert set(report["gbps"]) == set(report["seconds"]) == legs
    assert all(v > 0 for v in report["gbps"].values())
    assert set(report["ratios"]) == set(RATIOS)
    for ratio in report["ratios"].values():
        assert ratio["met"] == (ratio["value"] >= ratio["goal"])
    assert report["goals"] == 3
