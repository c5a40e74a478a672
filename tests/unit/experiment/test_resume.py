"""Resume: a cell finished with the same fingerprint is not run again; anything else is."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.matrix import fingerprint
from pdcluster.experiment.run import cell_folder, to_run

TEXT = """
strategies = ["full", "progressive"]
[model]
path = "m"
[[clusters]]
name = "1p1d"
[[workloads]]
name = "w"
rate = 2.0
num = NUM
"""


def status(folder: Path, state: str, stamp: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "status.json").write_text(json.dumps({"state": state, "fingerprint": stamp}))


def test_resume_skips_only_cells_done_with_the_same_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "e.toml"
    path.write_text(TEXT.replace("NUM", "5"))
    experiment = load_experiment(path)
    out = tmp_path / "out"
    assert [must for _, must in to_run(experiment, out)] == [True, True]
    full, progressive = [cell for cell, _ in to_run(experiment, out)]
    status(cell_folder(out, full), "done", fingerprint(full, experiment))
    status(cell_folder(out, progressive), "failed", fingerprint(progressive, experiment))
    assert [must for _, must in to_run(experiment, out)] == [False, True]  # a failed cell runs again
    assert [must for _, must in to_run(experiment, out, force=True)] == [True, True]
    (cell_folder(out, progressive) / "status.json").unlink()  # interrupted: no status
    assert [must for _, must in to_run(experiment, out)] == [False, True]
    path.write_text(TEXT.replace("NUM", "6"))  # the cell changed: its old result is stale
    assert [must for _, must in to_run(load_experiment(path), out)] == [True, True]
