"""The experiment file: what it accepts, the cells it expands to, and clear errors for what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.experiment.load import ExperimentError, load_experiment
from pdcluster.experiment.matrix import expand

BASE = """
name = "t"
strategies = ["full", "progressive"]
[model]
path = "m"
[slo]
ttft_ms = 500
tpot_ms = 50
[[clusters]]
name = "1p1d"
[[workloads]]
name = "chat"
rates = [1.0, 4.0]
num = 10
input_len = [8, 64]
output_len = 16
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


def refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ExperimentError) as caught:
        load_experiment(write(tmp_path, text))
    assert str(caught.value).startswith(str(tmp_path / "exp.toml"))  # names the file
    return str(caught.value)


def test_the_product_and_its_names(tmp_path: Path) -> None:
    experiment = load_experiment(write(tmp_path, BASE))
    assert experiment.model.path == tmp_path / "m"  # relative to the file
    assert experiment.slo.limits() == {"ttft": 500.0, "tpot": 50.0}
    cells = expand(experiment)
    assert [c.key for c in cells] == [
        "1p1d.full.static@local__chat@1__r0", "1p1d.full.static@local__chat@4__r0",
        "1p1d.progressive.static@local__chat@1__r0", "1p1d.progressive.static@local__chat@4__r0",
    ]
    assert {c.workload.rate for c in cells} == {1.0, 4.0}


def test_repetitions_seeds_endpoints_and_an_explicit_list(tmp_path: Path) -> None:
    text = BASE.replace('name = "t"', 'name = "t"\nrepetitions = 2\nseeds = [7, 9]') + """
[[endpoints]]
name = "vllm"
url = "http://127.0.0.1:{port}"
workloads = ["chat@4"]
"""
    cells = expand(load_experiment(write(tmp_path, text)))
    assert len(cells) == 2 * 2 * 2 + 2
    endpoint_cells = [(c.key, c.seed) for c in cells if c.endpoint]
    assert endpoint_cells == [("vllm__chat@4__r0", 7), ("vllm__chat@4__r1", 9)]
    listed = BASE.replace('name = "t"', 'name = "t"\nmatrix = "list"') + """
[[cells]]
strategy = "progressive"
workload = "chat@4"
"""
    (only,) = expand(load_experiment(write(tmp_path, listed)))
    assert only.key == "1p1d.progressive.static@local__chat@4__r0"


def test_topology_places_replicas_on_nodes(tmp_path: Path) -> None:
    text = BASE + """
[[topologies]]
name = "two"
backend = "kernel"
[[topologies.nodes]]
name = "a"
replicas = ["prefill"]
nic_gbps = 1.0
[[topologies.nodes]]
name = "b"
replicas = ["decode"]
nic_gbps = 1.0
latency_ms = 0.5
"""
    (topology,) = load_experiment(write(tmp_path, text)).topologies
    assert topology.place(["prefill", "decode"]) == [0, 1]
    assert topology.nodes[1].latency_ms == 0.5


@pytest.mark.parametrize(("change", "message"), [
    (('name = "t"', 'name = "t"\nstrategy = "full"'), "top level: unknown key(s) strategy"),
    (("num = 10", "num = 10\nrate_scale = 2"), "workloads[0]: unknown key(s) rate_scale"),
    (("tpot_ms = 50", "tpot_ms = 50\nitl = 3"), "slo: unknown key(s) itl"),
    (("tpot_ms = 50", "tpot_ms = -5"), "slo: tpot_ms = -5.0 must be a positive number of milliseconds"),
    (("tpot_ms = 50", 'tpot_ms = "fast"'), "slo: tpot_ms = 'fast' must be float"),
    (("rates = [1.0, 4.0]", "rates = [0]"), "rate 0 must be a positive number"),
    (("input_len = [8, 64]", "input_len = [64, 8]"), "input_len must be a token count"),
    (('strategies = ["full", "progressive"]', "strategies = []"), "the matrix is empty"),
    (("[[workloads]]", "[[unused]]"), "unknown key(s) unused"),
])
def test_refusals_name_the_place_and_the_reason(tmp_path: Path, change: tuple[str, str],
                                                message: str) -> None:
    assert message in refused(tmp_path, BASE.replace(*change))


def test_an_experiment_without_workloads_is_an_empty_matrix(tmp_path: Path) -> None:
    text = BASE[: BASE.index("[[workloads]]")]
    assert "the matrix is empty: no [[workloads]]" in refused(tmp_path, text)


def test_a_topology_that_does_not_fit_the_cluster(tmp_path: Path) -> None:
    text = BASE + """
[[topologies]]
name = "small"
[[topologies.nodes]]
name = "a"
replicas = 1
"""
    assert "1 replica slots, the cluster 2 replicas" in refused(tmp_path, text)


def test_latency_needs_the_kernel_backend(tmp_path: Path) -> None:
    text = BASE + """
[[topologies]]
name = "slow"
[[topologies.nodes]]
name = "a"
replicas = 2
latency_ms = 1.0
"""
    assert 'need backend = "kernel"' in refused(tmp_path, text)


def test_not_toml(tmp_path: Path) -> None:
    assert "not valid TOML" in refused(tmp_path, "name = ")
