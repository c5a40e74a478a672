"""`pdcluster calibrate` on the CPU with a tiny card: a full grid the profile cost model reads, with
its provenance; the committed H100 tables load and agree with their provenance."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pdcluster.tools.calibrate import CalibrateConfig, run
from replica.engine.sim.cost import Fed
from replica.engine.sim.profile import ProfileCost

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "torch_dtype": "float32"}
PROFILES = Path(__file__).resolve().parents[3] / "replica" / "engine" / "sim" / "profiles"


def test_calibrate_writes_a_grid_the_profile_model_reads(tmp_path: Path) -> None:
    card = tmp_path / "config.json"
    card.write_text(json.dumps(TINY))
    out = tmp_path / "tiny.csv"
    config = CalibrateConfig(out, model_card=str(card), device="cpu", prefill_batch=[1, 2],
                             prefill_context=[8, 16], decode_batch=[1, 3], decode_context=[16, 32],
                             reps=2, warmup=1)
    assert run(config) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["phase"], int(r["batch_size"]), int(r["context_len"])) for r in rows] == [
        ("prefill", 1, 8), ("prefill", 1, 16), ("prefill", 2, 8), ("prefill", 2, 16),
        ("decode", 1, 16), ("decode", 1, 32), ("decode", 3, 16), ("decode", 3, 32)]
    assert all(float(r["ms"]) > 0 for r in rows)
    cost = ProfileCost.load(out, num_layers=3)
    assert cost.step([Fed(16, 0)]).total == pytest.approx(float(rows[1]["ms"]) / 1e3, rel=1e-3)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["device"].startswith("cpu") and meta["dtype"] == "float32"
    assert meta["command"].startswith(f"pdcluster calibrate {out} --model-card {card} --device cpu")
    assert len(meta["rates"]) == len(rows)


def test_calibrate_refuses_bad_grids_and_cards(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="> 0"):
        CalibrateConfig(tmp_path / "x.csv", prefill_batch=[0])
    with pytest.raises(ValueError, match="> 0"):
        CalibrateConfig(tmp_path / "x.csv", decode_context=[])
    with pytest.raises(ValueError, match="llama-2-7b"):
        CalibrateConfig(tmp_path / "x.csv", model_card="no-such-card")
    with pytest.raises(ValueError, match="--dtype"):
        CalibrateConfig(tmp_path / "x.csv", dtype="int8")
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize("card", ["llama-2-7b", "llama-2-13b"])
def test_committed_h100_profiles_load_and_match_their_provenance(card: str) -> None:
    table = PROFILES / f"h100-80g-{card}.csv"
    meta = json.loads(table.with_suffix(".json").read_text())
    assert meta["device"] == "NVIDIA H100 80GB HBM3" and meta["model_card"] == card
    cost = ProfileCost.load(table, num_layers=meta["card"]["num_hidden_layers"])
    for rate in meta["rates"]:
        b, c = rate["batch_size"], rate["context_len"]
        seqs = [Fed(c, 0)] * b if rate["phase"] == "prefill" else [Fed(1, c - 1)] * b
        assert cost.step(seqs).total * 1e3 == pytest.approx(rate["ms"], rel=1e-3, abs=1e-3)
