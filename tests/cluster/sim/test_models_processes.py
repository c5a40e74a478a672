"""Several models in an experiment of simulated-replica processes (`pdcluster experiment run`): the
same file `pdcluster simulate` runs (two models, one at zero) runs as processes too — every model's
folder made beside the first, the spare replica lent to the model at zero and loaded by LoadParams
under its name, every request answered. With topology `host_models` (the serving node's replicas
keep the second model in host memory, `--host-models`) the spare on the other node is woken from
their copies over the network (a share from each), not from disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.run import run_experiment
from tests.helpers.sim_files import topology

pytestmark = pytest.mark.long  # three replica processes and a router: ~30 s on 2 shared cores

CELL = "two.full.host-cache@nics__mixed__r0"
NODES = topology("nics", [("a", 3, ())])
# the first model's replicas on node a hold `second` in host memory; the spare on node b none
HELD = topology("nics", [("a", 2, ("second",)), ("b", 1, ())])


def _experiment(tmp_path: Path, tokenizer: Path, policy: str = "host-cache", nodes: str = NODES) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(f"""
name = "two models, one at zero, as processes"
strategies = ["full"]
policies = ["{policy}"]
seeds = [3]
request_timeout = 120
startup_timeout = 300
[model]
path = "{tokenizer}"
engine = "simulated"
gpu = "a100-80g"
model_card = "llama-2-7b"
byte_scale = "1/4096"
[slo]
ttft_ms = 1000
tpot_ms = 100
[[clusters]]
name = "two"
prefill = 1
decode = 1
inactive = 1
router_args = ["--models", "second=second,min-prefill=0,min-decode=0", "--wake-timeout", "120",
               "--heartbeat-timeout", "30"]
replica_args = ["--disk-gbps", "160", "--host-gbps", "2000", "--host-cache"]
[[workloads]]
name = "mixed"
rate = 4.0
num = 12
input_len = [64, 256]
output_len = [4, 8]
models = ["llama-2-7b", "second"]  # the first model is named after the card
{nodes}""")
    return path


def test_several_models_run_as_simulated_replica_processes(tmp_path: Path, tiny_llama: Path) -> None:
    experiment = load_experiment(_experiment(tmp_path, tiny_llama))
    run_experiment(experiment, tmp_path / "out", report=False)
    folder = tmp_path / "out" / "cells" / CELL
    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 12 and all(r["success"] for r in records), [r["error"] for r in records]
    log = (folder / "logs" / "router.log").read_text()
    assert "model second: spare replica" in log and "model second has no serving replica" in log
    assert "host cache miss, loading second from disk" in log  # the spare's copy is the first model's
    assert (folder / "model" / "second" / "config.json").is_file()


def test_a_model_at_zero_wakes_from_another_nodes_host_memory(tmp_path: Path, tiny_llama: Path) -> None:
    experiment = load_experiment(_experiment(tmp_path, tiny_llama, "multicast", HELD))
    run_experiment(experiment, tmp_path / "out", report=False)
    folder = tmp_path / "out" / "cells" / CELL.replace("host-cache", "multicast")
    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 12 and all(r["success"] for r in records), [r["error"] for r in records]
    timeline = [json.loads(line) for line in (folder / "timeline.second.jsonl").read_text().splitlines()]
    wake = next(r for r in timeline if r["kind"] == "wake")
    assert "host_peer" in wake["action"], wake
    moved = [r for r in timeline if r["kind"] == "transfer"]
    assert moved and moved[0]["method"] == "host_peer" and moved[0]["ok"], moved
    assert len(moved[0]["peers"]) == 2  # a share from each holder
    assert not any(r["method"] == "load_disk" for r in moved)
