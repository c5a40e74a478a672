"""`pdcluster bench grammar` end to end on the CPU (the 2-layer tiny model, small batch): every variant
timed with every request alive to the last step, the ratios and the goal written. No speed asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcluster.bench.grammar import SCHEMA, VARIANTS, BenchGrammarConfig, run
from pdcluster.cli.main import parse


def test_the_report_has_every_variant_and_ratio(tmp_path: Path) -> None:
    out = tmp_path / "grammar.json"
    flags = ["--quick", "--batch", "4", "--prompt-tokens", "8", "--decode-steps", "4", "--repeats", "2"]
    config = parse(["bench", "grammar", *flags, "--json", str(out)])
    assert isinstance(config, BenchGrammarConfig)
    assert run(config) == 0
    data = json.loads(out.read_text())
    assert set(data["step_ms"]) == set(VARIANTS)
    for variant in VARIANTS:
        step = data["step_ms"][variant]
        assert len(step["runs"]) == 2 and 0 < step["best"] <= step["median"]
    assert data["ratio_to_free"]["free"] == 1.0
    assert data["ratio_to_free"]["constrained"] == pytest.approx(
        data["step_ms"]["constrained"]["best"] / data["step_ms"]["free"]["best"]
    )
    assert data["meets_goal"] == (data["ratio_to_free"]["constrained"] <= data["goal"])
    assert 0 < data["mask_ms"]["best"] <= data["mask_ms"]["median"]
    assert data["schema"] == SCHEMA and data["model"].startswith("tiny")


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        BenchGrammarConfig(batch=0)
