"""Several models in virtual time repeat byte for byte: the same file and seed, run twice, give the
same `requests.jsonl` and the same timeline (its wall-clock stamps aside). Guards against wall-clock
time leaking into the router's measurements (a prefill's seconds read on `time.monotonic` fed the
planner's prefill speed, so a run's decisions depended on how fast the CPU went)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest

from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.run import run_experiment
from pdcluster.sim import cell as cell_module
from pdcluster.sim.cell import execute
from pdcluster.sim.cluster import VirtualCluster
from tests.helpers.sim_files import simulated_model

CELL = "two.full.live@nics__burst__r0"


def _experiment(tmp_path: Path, tokenizer: Path) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(f"""
name = "two models, a burst"
strategies = ["full"]
policies = ["live"]
seeds = [7]
{simulated_model(tokenizer)}\
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


class _Watched(VirtualCluster):
    """Records, when the run ends, what each replica still holds."""

    held: ClassVar[dict[int, tuple[int, int]]] = {}

    async def stop(self) -> None:
        for replica in self.replicas:
            engine = replica.engine
            _Watched.held[replica.rank] = (engine.blocks.num_used, len(replica.zigzag.tasks))
        await super().stop()


def test_live_scaling_serves_layer_by_layer_and_relays_in_virtual_time(
        tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `live` a new prefill replica serves ZagPrefill while its weights land, loaded ones
    relay its batches after k layers, and both KV halves reach one decode replica: every request
    succeeds, and no replica keeps a page or a layer-level task at the end."""
    monkeypatch.setattr(cell_module, "VirtualCluster", _Watched)
    _Watched.held.clear()
    run_experiment(load_experiment(_experiment(tmp_path, tiny_llama)), tmp_path / "out", report=False,
                   execute=execute)
    folder = tmp_path / "out" / "cells" / CELL
    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    assert all(r["success"] for r in records), {r["error"] for r in records}
    timeline = _timeline(folder)
    relays = [r for r in timeline if r["kind"] == "relay"]
    assert any(int(str(r["layer"])) >= 1 for r in relays)  # resumed on the old replica after k layers
    # the burst's first scale-up: an urgent round with no inactive replica got a shared spare at once
    # (router/pools.py) and planned again, before the next sharing round
    first = next(r for r in timeline if r["kind"] == "plan" and r["actions"])
    assert str(first["reason"]).endswith("a spare lent at once") and float(str(first["t"])) % 0.25 != 0
    assert any(r["target"] == "new_prefill" for r in timeline if r["kind"] == "transition")
    zig = [r for r in records if r["route"]["strategy"] == "zigzag"]
    assert any(r["route"]["relay_replica"] is not None for r in zig)
    assert _Watched.held and all(held == (0, 0) for held in _Watched.held.values()), _Watched.held
