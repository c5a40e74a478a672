"""`pdcluster simulate`: an experiment file's cells in virtual time — the same seed gives the same
requests.jsonl byte for byte, the cell's summary says virtual time, and refused cells say why."""

from __future__ import annotations

from pathlib import Path

from pdcluster.sim.cli import SimulateConfig, run

EXPERIMENT = """
name = "virtual-time test"
strategies = ["full", "progressive"]
seeds = [3]

[model]
path = "no-checkpoint-needed"
engine = "simulated"
gpu = "a100-80g"
model_card = "llama-2-7b"

[slo]
ttft_ms = 500
tpot_ms = 50

[[clusters]]
name = "1p2d"
prefill = 1
decode = 2

[[workloads]]
name = "poisson"
arrival = "poisson"
rate = 6.0
num = 60
input_len = [64, 900]
output_len = [8, 64]

[[topologies]]
name = "nic25"
[[topologies.nodes]]
name = "p"
replicas = 1
nic_gbps = 25.0
[[topologies.nodes]]
name = "d"
replicas = 2
nic_gbps = 25.0
"""


def _cells(out: Path) -> dict[str, Path]:
    return {p.parent.name: p for p in sorted(out.glob("cells/*/requests.jsonl"))}


def test_same_seed_same_requests_byte_for_byte(tmp_path: Path) -> None:
    spec = tmp_path / "exp.toml"
    spec.write_text(EXPERIMENT)
    first, second = tmp_path / "a", tmp_path / "b"
    assert run(SimulateConfig(spec, first)) == 0
    assert run(SimulateConfig(spec, second)) == 0
    a, b = _cells(first), _cells(second)
    assert len(a) == 2 and a.keys() == b.keys()
    for key in a:
        assert a[key].read_bytes() == b[key].read_bytes(), key
        lines = a[key].read_text().splitlines()
        assert len(lines) == 60 and '"success": true' in lines[0]
    summary = (next(iter(a.values())).parent / "summary.json").read_text()
    assert '"virtual_time": true' in summary
    assert (first / "report.md").is_file()


def test_a_torch_cluster_is_refused_naming_why(tmp_path: Path) -> None:
    spec = tmp_path / "exp.toml"
    spec.write_text(EXPERIMENT.replace('engine = "simulated"', 'engine = "torch"'))
    out = tmp_path / "out"
    assert run(SimulateConfig(spec, out)) == 1  # every cell failed, each with its reason
    errors = list(out.glob("cells/*/error.txt"))
    assert len(errors) == 2 and all("torch engine" in p.read_text() for p in errors)
    assert not _cells(out)


def test_a_bad_file_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    spec = tmp_path / "exp.toml"
    spec.write_text(EXPERIMENT.replace('gpu = "a100-80g"', 'gpu = "tpu-v9"'))
    out = tmp_path / "out"
    assert run(SimulateConfig(spec, out)) == 2
    assert not out.exists()
