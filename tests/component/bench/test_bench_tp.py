"""`pdcluster bench tp --quick`: both variants measured, ratios and the collectives' share reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcluster.bench.tp import BenchTpConfig, run


@pytest.mark.long
def test_bench_tp_quick_writes_ratios(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    assert run(BenchTpConfig(json=out, quick=True, batch=2, prompt_tokens=8, decode_steps=2, repeats=1)) == 0
    result = json.loads(out.read_text())
    assert set(result["step_ms"]) == {"tp1", "tp1_rank_threads", "tp2"}
    assert result["ratio_best"] > 0 and result["ratio_to_rank_threads_best"] > 0
    assert 0 < result["collectives"]["share"] < 1


def test_bench_tp_refuses_one_rank() -> None:
    with pytest.raises(ValueError, match="--tp must be at least 2"):
        BenchTpConfig(tp=1)
