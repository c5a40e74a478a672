"""A model at zero woken from another node's host memory in virtual time: the node of the first
model's prefill replica holds a host copy of `second` (topology `host_models`); under `live` the
spare lent to `second` receives that copy over the sender's 100 Gbit/s NIC (13.5 GB of a 7 B model:
1.08 s, host memory being faster), its regions landing as they go; under `host-cache`
(ServerlessLLM) the spare's own host memory misses and it loads from the 16 Gbit/s disk (6.7 s);
with a second spare whose node holds `second`, that one is lent and loads from its host memory
(0.54 s at 200 Gbit/s: the lend is locality-aware); with two nodes holding it, each sends half
(0.54 s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdcluster.experiment.cluster import CellCluster
from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.matrix import expand
from pdcluster.experiment.run import run_experiment
from pdcluster.sim.cell import execute, shape_of
from tests.helpers.sim_files import simulated_model, topology


def _experiment(tmp_path: Path, tokenizer: Path) -> Path:
    path = tmp_path / "peer.toml"
    path.write_text(f"""
name = "a model at zero, its host copy on another node"
strategies = ["full"]
policies = ["live", "host-cache"]
matrix = "list"
seeds = [0]
{simulated_model(tokenizer)}\
[[clusters]]
name = "two"
prefill = 1
decode = 1
inactive = 1
router_args = ["--models", "second=second,min-prefill=0,min-decode=0", "--wake-timeout", "60"]
replica_args = ["--disk-gbps", "16", "--host-gbps", "200"]
[[clusters]]
name = "three"
prefill = 1
decode = 1
inactive = 2
router_args = ["--models", "second=second,min-prefill=0,min-decode=0", "--wake-timeout", "60"]
replica_args = ["--disk-gbps", "16", "--host-gbps", "200"]
[[workloads]]
name = "second"
rate = 4.0
num = 6
input_len = [128, 256]
output_len = [4, 8]
models = ["second"]
{topology("nics", [("a", 1, ["second"]), ("b", 1, []), ("c", 1, [])])}\
{topology("spares", [("a", 2, []), ("c", 1, []), ("d", 1, ["second"])])}\
{topology("both", [("a", 1, ["second"]), ("b", 1, ["second"]), ("c", 1, [])])}\
[[cells]]
workload = "second"
cluster = "two"
topology = "both"
policy = "live"
[[cells]]
workload = "second"
cluster = "two"
topology = "nics"
policy = "live"
[[cells]]
workload = "second"
cluster = "two"
topology = "nics"
policy = "host-cache"
[[cells]]
workload = "second"
cluster = "three"
topology = "spares"
policy = "host-cache"
""")
    return path


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    tmp = tmp_path_factory.mktemp("peer")
    run_experiment(load_experiment(_experiment(tmp, tiny_llama)), tmp / "out", report=False, execute=execute)
    return tmp / "out" / "cells"


def _read(folder: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / name).read_text().splitlines()]


@pytest.mark.parametrize(("cell", "method", "target", "seconds"), [
    ("two.full.live@nics", "host_peer", "sim://2", 13.5e9 / 12.5e9),
    ("two.full.live@both", "host_peer", "sim://2", 13.5e9 / 25e9),  # half from each of two holders
    ("two.full.host-cache@nics", "load_host", "sim://2", 13.5e9 / 2e9),  # a miss: from disk
    ("three.full.host-cache@spares", "load_host", "sim://3", 13.5e9 / 25e9)])  # the spare holding it
def test_the_wake_reads_a_peers_host_memory_only_under_live(cells: Path, cell: str, method: str,
                                                            target: str, seconds: float) -> None:
    folder = cells / f"{cell}__second__r0"
    records = _read(folder, "requests.jsonl")
    assert len(records) == 6 and all(r["success"] for r in records)
    timeline = _read(folder, "timeline.jsonl")
    wake = next(r for r in timeline if r["kind"] == "wake")
    assert wake["model"] == "second" and method in str(wake["action"])
    transfer = next(r for r in timeline if r["kind"] == "transfer")
    joined = {r["replica"]: r["address"] for r in timeline if r["kind"] == "replica"}
    assert transfer["method"] == method and [joined[t] for t in transfer["targets"]] == [target]
    holders = ["sim://0", "sim://1"] if cell.endswith("both") else ["sim://0"]
    assert transfer.get("peers", []) == (holders if method == "host_peer" else [])
    assert transfer["seconds"] == pytest.approx(seconds, rel=0.02)  # the real bytes at the link's rate
    first = min(records, key=lambda r: float(r["start"]))
    assert seconds < float(first["ttft"]) < seconds + 1.0  # it waited for the load, then prefilled


def test_a_wake_with_no_spare_reclaims_a_quiet_models_replica(tmp_path: Path, tiny_llama: Path) -> None:
    """Both replicas serve the first model, which gets no request: `second`'s wake finds no spare and
    takes the quiet model's prefill replica (drained, reset, lent); every request succeeds."""
    path = _experiment(tmp_path, tiny_llama)
    text = path.read_text().replace('inactive = 1\n', 'inactive = 0\n', 1)
    text = text.replace('"second=second,min-prefill=0,min-decode=0"',
                        '"second=second", "--min-prefill", "0", "--min-decode", "0"', 1)
    path.write_text(text.replace('name = "c"\nreplicas = 1', 'name = "c"\nreplicas = 0', 1))
    key = "two.full.live@nics__second__r0"
    run_experiment(load_experiment(path), tmp_path / "out", report=False, execute=execute, only=[key])
    folder = tmp_path / "out" / "cells" / key
    assert all(r["success"] for r in _read(folder, "requests.jsonl"))
    timeline = _read(folder, "timeline.jsonl")
    reclaimed = [r for r in timeline if r["kind"] == "reclaimed"]
    assert reclaimed and reclaimed[0]["model"] == "llama-2-7b" and reclaimed[0]["waking"] == "second"
    wake = next(r for r in timeline if r["kind"] == "wake")
    assert "load_host" in wake["action"]  # replica 0's node holds `second` in host memory: a hit there


def test_the_scale_to_zero_example_loads_and_places_its_host_copies() -> None:
    """examples/blitzscale-zero-sim.toml (run by hand, ~70 s): 15 cells; every elastic node's host
    memory holds two models at start; as processes, each replica starts with `--host-models`."""
    experiment = load_experiment(Path(__file__).parents[3] / "examples" / "blitzscale-zero-sim.toml")
    cells = expand(experiment)
    assert len(cells) == 15 and {c.policy for c in cells} == {"live", "multicast", "stop-the-world",
                                                                 "host-cache", "static"}
    nine = next(c for c in cells if c.key.startswith("elastic9.full.live"))
    places = shape_of(experiment, nine).places
    assert nine.cluster is not None
    assert len(places) == 9 and places[0].host_models == ("llama-2-7b", "m4")
    assert all(len(p.host_models) == 2 for p in places)
    procs = CellCluster(experiment.model, nine.cluster, "full", "live", nine.topology, Path("."))
    assert procs.host_model_args(0) == ["--host-models", "llama-2-7b", "m4"]  # as processes: each replica's
