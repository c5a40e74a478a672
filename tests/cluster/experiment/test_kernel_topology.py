"""The kernel topology backend: replicas in network namespaces joined by tc-shaped veth links.

A 1 Gbit/s link between the prefill and the decode node: the migration of a large batch (up to 8 × 500
prompt tokens of a model with 64 KiB of KV per token, 256 MiB) takes bytes / link rate within 20 %.
Afterwards nothing of the run is left. Skips without root, ip or tc.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from pdcluster.experiment import netns
from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.run import run_experiment

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "kernel backend available")
LINK_GBPS = 1.0


def big_kv_model(factory: Callable[..., Path]) -> Path:
    # 8 layers × 8 KV heads × head_dim 128 × K and V × 4 bytes = 64 KiB of KV per token
    return factory(layers=8, hidden=64, heads=8, kv_heads=8, head_dim=128, intermediate=128,
                   max_positions=1024)


def test_migration_over_a_shaped_link_takes_bytes_over_rate(tmp_path: Path,
                                                            tiny_model_factory: Callable[..., Path]) -> None:
    path = tmp_path / "link.toml"
    path.write_text(f"""
strategies = ["full"]
request_timeout = 240
[model]
path = "{big_kv_model(tiny_model_factory)}"
num_blocks = 320
[[clusters]]
name = "1p1d"
# one migration at a time: a batch split in two would otherwise share the link with the other half
router_args = ["--max-inbound-migrations", "1"]
[[workloads]]
name = "burst"
rate = "inf"
num = 8
input_len = 500
output_len = 4
[[topologies]]
name = "two-nodes"
backend = "kernel"
[[topologies.nodes]]
name = "a"
replicas = ["prefill"]
nic_gbps = {LINK_GBPS}
[[topologies.nodes]]
name = "b"
replicas = ["decode"]
nic_gbps = {LINK_GBPS}
""")
    result = run_experiment(load_experiment(path), tmp_path / "out", report=False)
    ((key, outcome),) = result.ran.items()
    folder = tmp_path / "out" / "cells" / key
    assert outcome.state == "done", (folder / "error.txt").read_text() if outcome.error else ""
    requests = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    assert [q["error"] for q in requests] == [""] * 8
    routes = [q["route"] for q in requests]
    batches: dict[float, int] = {}
    for route in routes:  # the requests of one batch share its migration time
        seconds = route["migration_seconds"]
        batches[seconds] = batches.get(seconds, 0) + route["migration_bytes"]
    seconds, nbytes = max(batches.items(), key=lambda item: item[1])
    assert nbytes >= 120 * 2**20, batches  # at least half of the 256 MiB in one batch
    expected = nbytes / (LINK_GBPS * 1e9 / 8)
    print(f"migration of {nbytes / 2**20:.0f} MiB: {seconds:.3f} s, bytes / link rate {expected:.3f} s, "
          f"ratio {seconds / expected:.3f}")
    assert 0.8 * expected <= seconds <= 1.2 * expected
    network = json.loads((folder / "network.json").read_text())
    made = [network["head"], network["switch"], *(n["namespace"] for n in network["nodes"].values())]
    assert not set(made) & set(netns.namespaces())
    assert not (netns.MARKERS / f"{network['run_id']}.pid").exists()
    assert not netns.host_addresses()


def test_stale_runs_are_swept_and_live_ones_kept() -> None:
    stale, live = "pdcx-0badc0de-n0", "pdcx-0feedbee-n0"
    dead = subprocess.Popen(["true"])
    dead.wait()
    netns.MARKERS.mkdir(parents=True, exist_ok=True)
    (netns.MARKERS / "0badc0de.pid").write_text(f"{dead.pid}\n")
    (netns.MARKERS / "0feedbee.pid").write_text(f"{os.getpid()}\n")
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True)
        assert stale in netns.sweep()
        names = netns.namespaces()
        assert stale not in names and live in names
        assert not (netns.MARKERS / "0badc0de.pid").exists()
    finally:
        subprocess.run(["ip", "netns", "del", live], check=False)
        subprocess.run(["ip", "netns", "del", stale], check=False)
        (netns.MARKERS / "0feedbee.pid").unlink(missing_ok=True)
