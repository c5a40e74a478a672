"""Several models in virtual time: requests assigned to models, a model at zero woken by its first
request (under host-cache: a miss, the spare's copy is the other model's → disk; the shared spare
replica lent), and the comparison's ratios."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from pdcluster.bench.serving.workload import Arrival
from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.run import run_experiment
from pdcluster.experiment.workloads import assign_models
from pdcluster.sim.cell import execute
from pdcluster.sim.ratios import cell_figures, ratios, replica_seconds
from tests.helpers.sim_files import simulated_model

CELL = "two.full.host-cache@nics__mixed__r0"


def _experiment(tmp_path: Path, tokenizer: Path) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(f"""
name = "two models, one at zero"
strategies = ["full"]
policies = ["host-cache"]
seeds = [3]
{simulated_model(tokenizer)}\
[[clusters]]
name = "two"
prefill = 1
decode = 1
inactive = 2
router_args = ["--models", "second=second,min-prefill=0,min-decode=0", "--wake-timeout", "60"]
replica_args = ["--disk-gbps", "16", "--host-gbps", "200", "--host-cache"]
[[workloads]]
name = "mixed"
rate = 4.0
num = 24
input_len = [128, 512]
output_len = [8, 16]
models = ["llama-2-7b", "second"]
[[topologies]]
name = "nics"
[[topologies.nodes]]
name = "a"
replicas = 4
nic_gbps = 100.0
""")
    return path


def test_a_model_at_zero_is_woken_in_virtual_time_and_every_request_succeeds(
        tmp_path: Path, tiny_llama: Path) -> None:
    run_experiment(load_experiment(_experiment(tmp_path, tiny_llama)), tmp_path / "out", report=False,
                   execute=execute)
    folder = tmp_path / "out" / "cells" / CELL
    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 24 and all(r["success"] for r in records)
    timeline = [json.loads(line) for line in (folder / "timeline.jsonl").read_text().splitlines()]
    wakes = [r for r in timeline if r["kind"] == "wake"]
    assert wakes and wakes[0]["model"] == "second" and "load_host" in wakes[0]["action"]
    first = min(r["start"] for r in records if r["route"]["prefill_replica"] >= 2)  # the lent spare's
    # a 7 B model from the emulated 2 GB/s disk (the inactive replica's host copy is the other model)
    assert max(r["ttft"] for r in records if r["start"] <= first) > 6.0


def test_models_are_drawn_by_zipf_like_popularity_and_reproducibly() -> None:
    requests = [Arrival(i * 0.1, 100, 10) for i in range(4000)]
    drawn = assign_models(requests, ["a", "b", "c"], seed=5)
    assert drawn == assign_models(requests, ["a", "b", "c"], seed=5)
    counts = Counter(a.model for a in drawn)
    assert counts["a"] > counts["b"] > counts["c"] > 0  # weights 1, 1/2, 1/3
    assert abs(counts["a"] / counts["b"] - 2) < 0.3
    assert assign_models(requests, [], seed=5) == requests


def test_replica_seconds_count_held_weights_until_a_replica_leaves_its_pool() -> None:
    timeline = [
        {"kind": "replica", "replica": 0, "state": "prefill", "t": 0.0},
        {"kind": "replica", "replica": 1, "state": "inactive", "t": 0.0},
        {"kind": "transition", "replica": 1, "target": "loading_decode", "t": 2.0},
        {"kind": "transition", "replica": 1, "target": "inactive", "t": 5.0},
        {"kind": "replica_left", "replica": 1, "t": 6.0},
        {"kind": "replica", "replica": 2, "state": "inactive", "t": 6.0},  # joined another model
        {"kind": "transition", "replica": 2, "target": "prefill", "t": 8.0},
    ]
    assert replica_seconds(timeline, end=10.0) == 10.0 + 3.0 + 2.0


def test_ratios_set_live_against_each_goal() -> None:
    def cell(policy: str, ttft: float, slo: float, seconds: float) -> dict[str, object]:
        return {"policy": policy, "workload": "w", "p99_ttft_ms": ttft, "slo_attainment_pct": slo,
                "replica_seconds": seconds}

    cells = [cell("live", 300, 97.0, 50), cell("stop-the-world", 1000, 80, 60),
             cell("host-cache", 500, 90, 55), cell("static", 250, 99.5, 100)]
    figures = ratios(cells)["w"]["ratios"]
    assert figures["p99_ttft_vs_stop_the_world"] == {"ratio": 0.3, "goal": 0.3, "met": True}
    assert figures["p99_ttft_vs_host_cache"]["met"] is False  # 0.6 > 0.5
    assert figures["replica_seconds_vs_static_peak"] == {"ratio": 0.5, "goal": 0.6, "met": True}
    assert figures["slo_points_vs_static_peak"] == {"points": -2.5, "goal": -2.0, "met": False}


def test_a_process_cell_sums_every_models_timeline_to_the_cells_end(tmp_path: Path) -> None:
    """`experiment run` writes a timeline per model, on its own clock, and no virtual end: each
    file's spans end where the cell finished (status.json, wall clock)."""
    cell = tmp_path / "two.full.live@nics__w__r0"
    cell.mkdir()
    summary = {"workload": "w", "p99_ttft_ms": 700.0, "slo_attainment": {"all": 0.99}}
    (cell / "summary.json").write_text(json.dumps(summary))
    (cell / "status.json").write_text(json.dumps({"state": "done", "finished": 1000.0}))
    first = [{"t": 0.5, "wall": 980.0, "kind": "replica", "replica": 0, "state": "prefill"}]
    second = [{"t": 0.0, "wall": 985.0, "kind": "replica", "replica": 1, "state": "inactive"},
              {"t": 5.0, "wall": 990.0, "kind": "transition", "replica": 1, "target": "decode"}]
    for name, records in (("timeline.jsonl", first), ("timeline.second.jsonl", second)):
        (cell / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = cell_figures(cell)
    assert figures["policy"] == "live" and figures["replica_seconds"] == 20.0 + 10.0
