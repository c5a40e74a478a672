"""`pdcluster bench scaling --engine simulated`: the design and the experiment file it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.matrix import expand
from pdcluster.experiment.scaling.bench import SIMULATED, BenchScalingConfig, card_bytes, design_of
from pdcluster.experiment.scaling.design import Bandwidths, Reference, experiment_toml
from pdcluster.experiment.scaling.results import describe


def simulated(tmp_path: Path, **more: object) -> BenchScalingConfig:
    options: dict[str, object] = {"gpu": "h100-80g", "model_card": "llama-2-7b", "byte_scale": "1/512",
                                  **more}
    return BenchScalingConfig(out=tmp_path / "out", work=tmp_path / "work", engine="simulated",
                              **options)  # type: ignore[arg-type]


def test_the_simulated_design_names_the_engine_and_keeps_full_scale_bandwidths(tmp_path: Path) -> None:
    design = design_of(simulated(tmp_path, systems=["live", "static-peak"]))
    assert design.bandwidths == Bandwidths(100.0, 16.0, 200.0) == Bandwidths.full_scale()
    assert design.phases == SIMULATED.phases and design.slo_ttft_ms == SIMULATED.slo_ttft_ms
    assert design.num_blocks is None  # what the simulated GPU's memory leaves
    # the checkpoint lends its tokenizer only: its weights are tiny
    assert (design.model / "tokenizer.json").is_file()
    assert sum(p.stat().st_size for p in design.model.glob("*.safetensors")) < 1_000_000
    assert design.notes["checkpoint_bytes"] == card_bytes("llama-2-7b")
    assert 13e9 < card_bytes("llama-2-7b") < 14e9  # 6.7 B parameters in 16-bit weights

    path = tmp_path / "scaling.toml"
    path.write_text(experiment_toml(design))
    experiment = load_experiment(path)
    engine = experiment.model.engine
    assert (engine.kind, engine.gpu, engine.model_card, engine.byte_scale) == (
        "simulated", "h100-80g", "llama-2-7b", "1/512")
    assert experiment.model.num_blocks is None
    cells = {c.key: c for c in expand(experiment)}
    assert sorted(cells) == ["burst.full.live@nics__burst__r0", "peak.full.static@nics__burst__r0"]
    live = cells["burst.full.live@nics__burst__r0"]
    assert live.cluster is not None and live.cluster.engine == engine  # clusters inherit [model]'s engine
    # full-scale rates as given: the simulated replicas multiply them by their byte scale themselves
    assert live.cluster.replica_args == ("--disk-gbps", "16", "--host-gbps", "200")
    assert [n.nic_gbps for n in live.topology.nodes] == [100.0] * 4
    assert "--prefill-upper" in live.cluster.router_args
    assert experiment.request_timeout == SIMULATED.request_timeout

    # load times are the reference cluster's: the card's bytes at its rates
    loads = describe(design)["load_seconds"]
    reference = Reference()
    assert loads["disk"] == pytest.approx(reference.seconds(16.0), rel=0.05)  # ~7 s from NVMe
    assert loads["p2p"] == pytest.approx(reference.seconds(100.0), rel=0.05)  # ~1.1 s over the NIC


def test_flags_override_the_simulated_preset_and_torch_writes_no_engine(tmp_path: Path) -> None:
    design = design_of(simulated(tmp_path, phases=["5:1", "5:8"], link_gbps=25.0, slo_ttft_ms=500.0,
                                 profile=None))
    assert design.phases == ((5.0, 1.0), (5.0, 8.0)) and design.slo_ttft_ms == 500.0
    assert design.bandwidths == Bandwidths(25.0, 16.0, 200.0)
    model = experiment_toml(design).partition("[model]")[2].partition("[slo]")[0]
    assert 'engine = "simulated"' in model and "profile" not in model and "num_blocks" not in model
    torch = design_of(BenchScalingConfig(work=tmp_path / "work", quick=True))
    text = experiment_toml(torch)
    assert "engine =" not in text and "num_blocks = " in text


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--quick"):
        simulated(tmp_path, quick=True)
    with pytest.raises(ValueError, match="a100-80g"):  # an unknown GPU names the known ones
        BenchScalingConfig(engine="simulated", gpu="tpu-v9")
    with pytest.raises(ValueError, match="byte_scale"):
        simulated(tmp_path, byte_scale="2")
