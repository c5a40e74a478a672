"""The router's count of one replica's weight bytes (what a scale-up moves), with and without weight files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replica.engine.sim.cards import card_dict, card_dtype, load_card
from replica.model.layout import WeightLayout
from router.main import weight_bytes


@pytest.mark.parametrize("card", ["llama-2-7b", "llama-3-8b", "qwen2-1.5b"])
def test_a_folder_without_weights_counts_its_config(tmp_path: Path, card: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(card_dict(card)))
    layout = WeightLayout.for_config(load_card(card), card_dtype(card))
    # the replica's own layout of the card: exact without biases, within 0.1 % with them (qwen2)
    assert weight_bytes(tmp_path, card_dtype(card)) == pytest.approx(layout.total_bytes, rel=1e-3)
    if card == "llama-2-7b":
        assert weight_bytes(tmp_path, "bfloat16") == layout.total_bytes == 2 * 6_738_415_616


def test_weight_files_are_counted_from_their_headers(tmp_path: Path) -> None:
    import numpy as np

    from pdcluster.tools.tiny_model import write_safetensors

    (tmp_path / "config.json").write_text(json.dumps(card_dict("llama-2-7b")))  # ignored: files exist
    write_safetensors(tmp_path / "model.safetensors", {"a": np.zeros((3, 4), np.float32)}, "float32")
    assert weight_bytes(tmp_path, "float32") == 12 * 4
    assert weight_bytes(tmp_path / "missing", "float32") == 0
