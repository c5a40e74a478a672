"""`--dry-run` lists every cell of the file, and says `skip` for those `--only` leaves out."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.experiment.cli import ExperimentRunConfig, run_matrix

EXAMPLE = Path(__file__).parents[3] / "examples" / "blitzscale-zero-sim.toml"


def test_dry_run_marks_the_cells_only_leaves_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = ExperimentRunConfig(EXAMPLE, tmp_path, only=["elastic9.full.live"], dry_run=True)
    assert run_matrix(config, "pdcluster experiment") == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 15
    assert [line for line in lines if not line.startswith("skip ")] == [
        "run  elastic9.full.live@nics__azure-conv-9__r0"]
