"""Several models in virtual time repeat byte for byte: the same file and seed, run twice, give the
same `requests.jsonl` and the same timeline (its wall-clock stamps aside). Guards against wall-clock
time leaking into the router's measurements (a prefill's seconds read on `time.monotonic` fed the
planner's prefill speed, so a run's decisions depended on how fast the CPU went)."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.run import run_experiment
from pdcluster.sim.cell import execute

CELL = "two.full.live@nics__burst__r0"


def _experiment(tmp_path: Path, tokenizer: Path) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(f"""
name = "two models, a burst"
strategies = ["full"]
policies = ["live"]
seeds = [7]
[model]
path = "{tokenizer}"
engine = "simulated"
gpu = "a100-80g"
model_card = "llama-2-7b"
[slo]
ttft_ms = 1000
tpot_ms = 100
[[clusters]]
name = "two"
prefill = 2
decode = 2
inactive = 2
router_args = ["--models", "second=second", "--min-prefill", "1", "--min-decode", "1", "--max-prefill", "2",
               "--max-decode", "2", "--ttft-slo", "1", "--keep-alive", "2", "--cooldown", "2"]
replica_args = ["--disk-gbps", "16", "--host-gbps", "200"]
[[workloads]]
name = "burst"
rate = 40.0
num = 80
input_len = [256, 2048]
output_len = [4, 24]
models = ["llama-2-7b", "second"]
[[topologies]]
name = "nics"
[[topologies.nodes]]
name = "a"
replicas = 3
nic_gbps = 100.0
[[topologies.nodes]]
name = "b"
replicas = 3
nic_gbps = 100.0
""")
    return path


def _timeline(folder: Path) -> list[dict[str, object]]:
    records = [json.loads(line) for line in (folder / "timeline.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("wall")
    return records


def test_a_several_model_cell_repeats_byte_for_byte(tmp_path: Path, tiny_llama: Path) -> None:
    experiment = load_experiment(_experiment(tmp_path, tiny_llama))
    folders = []
    for run in ("first", "second"):
        run_experiment(experiment, tmp_path / run, report=False, execute=execute)
        folders.append(tmp_path / run / "cells" / CELL)
    first, second = folders
    requests = (first / "requests.jsonl").read_bytes()
    assert len(requests.splitlines()) == 80
    assert requests == (second / "requests.jsonl").read_bytes()
    timeline = _timeline(first)
    assert any(r["kind"] == "plan" and r["actions"] for r in timeline)  # the planner acted in it
    assert timeline == _timeline(second)
