"""`pdcluster experiment run FILE --out DIR`: every cell of the matrix, resumable, then the report.

```
 DIR/experiment.toml     a copy of the file that was run
     matrix.json         the keys of its cells (what the report shows)
     cells/<key>/        one folder per cell (cell.py)
     report.md, plots/   rebuilt from the cells on disk (report.py)
```
A cell whose status is `done` with the current fingerprint is not run again (`--force` runs it
again); a failed, skipped or interrupted cell is. One progress bar counts cells; its postfix shows
the running cell's requests and how long it may still take.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pdcluster.experiment.cell import Outcome, read_status, run_cell
from pdcluster.experiment.matrix import Cell, expand, fingerprint
from pdcluster.experiment.results import MATRIX
from pdcluster.experiment.spec import Experiment, ModelSpec


@dataclass(frozen=True)
class RunResult:
    """What a run did."""

    ran: dict[str, Outcome]
    reused: tuple[str, ...]
    report: Path | None


def finished(folder: Path, stamp: str) -> bool:
    """Whether the cell in `folder` is done and was run with fingerprint `stamp`."""
    status = read_status(folder)
    return status.get("state") == "done" and status.get("fingerprint") == stamp


def to_run(experiment: Experiment, out: Path, force: bool = False) -> list[tuple[Cell, bool]]:
    """Each cell and whether it must run (not finished with its current fingerprint, or `force`)."""
    return [(cell, force or not finished(cell_folder(out, cell), fingerprint(cell, experiment)))
            for cell in expand(experiment)]


def cell_folder(out: Path, cell: Cell) -> Path:
    """Where a cell's files go."""
    return out / "cells" / cell.key


def ensure_model(model: ModelSpec) -> None:
    """Build the tiny checkpoint the file describes when its folder is missing."""
    if (model.path / "config.json").is_file():
        return
    if not model.tiny:
        raise FileNotFoundError(f"model {model.path} has no config.json (give [model] tiny = {{…}} to "
                                "build one)")
    from pdcluster.tools.tiny_model import TinyModelConfig, make_tiny_model

    make_tiny_model(TinyModelConfig(out=model.path, **model.tiny))


def run_experiment(experiment: Experiment, out: Path, force: bool = False, only: Sequence[str] = (),
                   report: bool = True) -> RunResult:
    """Run the cells that are not finished (those whose key contains one of `only`, when given)."""
    plan = [(c, must) for c, must in to_run(experiment, out, force)
            if not only or any(o in c.key for o in only)]
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(experiment.source, out / "experiment.toml")
    # the report shows these cells only (folders of an earlier version of the file stay on disk)
    (out / MATRIX).write_text(json.dumps([cell.key for cell in expand(experiment)], indent=1) + "\n")
    ensure_model(experiment.model)
    ran: dict[str, Outcome] = {}
    reused = []
    with tqdm(total=len(plan), unit="cell", file=sys.stderr, dynamic_ncols=True) as bar:
        for cell, must in plan:
            if not must:
                reused.append(cell.key)
                bar.update(1)
                continue
            bar.set_postfix_str(cell.key)

            def progress(done: int, total: int, eta: float, key: str = cell.key) -> None:
                left = f"{eta:.0f} s" if math.isfinite(eta) else "?"
                bar.set_postfix_str(f"{key}: {done}/{total} requests, cell ETA {left}")

            outcome = run_cell(experiment, cell, cell_folder(out, cell), progress)
            ran[cell.key] = outcome
            note = f": {outcome.error.splitlines()[0]}" if outcome.error else ""
            tqdm.write(f"{outcome.state:7} {cell.key} ({outcome.seconds:.0f} s){note}", file=sys.stderr)
            bar.update(1)
    path = None
    if report:
        from pdcluster.experiment.report import write_report

        path = write_report(out)
    return RunResult(ran, tuple(reused), path)
