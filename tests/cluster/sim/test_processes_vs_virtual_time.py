"""The simulator's fidelity at a reduced size: one experiment cell of simulated-GPU replicas run as
processes (the real router, fabric and load generator; replicas sleeping their modelled steps)
and in virtual time (`pdcluster simulate`): the same requests, outputs and KV bytes moved, and
latencies of the same scale.

Virtual time is the lower bound: the processes add their RPC, scheduling and Python costs to every
step, and on this shared 2-core machine those grow with its other load (they were +19…+33 % on
mean TPOT and +59…+94 % on mean TTFT at full size under load averages of 15–18; docs/performance.md).
So the bounds are one-sided within a small slack, and loose above: they fail when a side stops
modelling the GPU — a replica that does not sleep its step (TPOT far below), a link paced at the
unscaled rate (TTFT ×256), a virtual clock that skips or doubles steps.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.run import run_experiment
from pdcluster.sim.cell import execute

CELL = "1p2d.full.static@nic100__poisson__r0"


def _experiment(tmp_path: Path, tokenizer: Path) -> Path:
    path = tmp_path / "fidelity.toml"
    path.write_text(f"""
name = "fidelity, reduced"
strategies = ["full"]
seeds = [1]
request_timeout = 300
startup_timeout = 300
[model]
path = "{tokenizer}"
engine = "simulated"
gpu = "l4"
model_card = "llama-2-7b"
[slo]
ttft_ms = 1000
tpot_ms = 100
[[clusters]]
name = "1p2d"
prefill = 1
decode = 2
[[workloads]]
name = "poisson"
rate = 2.0
num = 60
input_len = [128, 768]
output_len = [16, 64]
[[topologies]]
name = "nic100"
[[topologies.nodes]]
name = "p"
replicas = ["prefill"]
nic_gbps = 100.0
[[topologies.nodes]]
name = "d"
replicas = ["decode", "decode"]
nic_gbps = 100.0
""")
    return path


def _cell(out: Path) -> tuple[dict[str, float], list[dict[str, object]]]:
    folder = out / "cells" / CELL
    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    return json.loads((folder / "summary.json").read_text()), records


def test_processes_and_virtual_time_agree(tmp_path: Path, tiny_llama: Path) -> None:
    experiment = load_experiment(_experiment(tmp_path, tiny_llama))
    run_experiment(experiment, tmp_path / "processes", report=False)
    run_experiment(experiment, tmp_path / "virtual", report=False, execute=execute)
    real, real_records = _cell(tmp_path / "processes")
    virtual, virtual_records = _cell(tmp_path / "virtual")
    assert len(real_records) == len(virtual_records) == 60
    assert all(r["success"] for r in real_records + virtual_records)
    for a, b in zip(real_records, virtual_records, strict=True):
        assert (a["input_len"], a["output_len"]) == (b["input_len"], b["output_len"])
        assert a["route"]["migration_bytes"] == b["route"]["migration_bytes"]  # type: ignore[index]
    # a decode step of Llama-2-7B on an L4 is ≈ 56 ms modelled: both sides must show it
    assert 50 < virtual["mean_tpot_ms"] < 90
    assert 0.9 < real["mean_tpot_ms"] / virtual["mean_tpot_ms"] < 2.0
    assert 0.8 < real["p50_ttft_ms"] / virtual["p50_ttft_ms"] < 3.0
