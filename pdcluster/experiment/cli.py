"""The `pdcluster experiment run` and `pdcluster experiment report` subcommands (configs and runners)."""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdcluster.experiment.run import Execute


@dataclass
class ExperimentRunConfig:
    """Flags of `pdcluster experiment run`."""

    file: Path = field(metadata={"help": "experiment file (TOML)", "positional": True})
    out: Path = field(metadata={"help": "output folder: one folder per cell, report.md, plots/"})
    force: bool = field(default=False, metadata={"help": "run finished cells again"})
    only: list[str] = field(default_factory=list, metadata={
        "help": "run only the cells whose folder name contains one of these strings"})
    dry_run: bool = field(default=False, metadata={"help": "list the cells and whether each would run"})


@dataclass
class ExperimentReportConfig:
    """Flags of `pdcluster experiment report`."""

    out: Path = field(metadata={"help": "an experiment's output folder", "positional": True})


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: every cell's processes and namespaces are removed


class MatrixFlags(Protocol):
    """The flags `run_matrix` reads (`pdcluster experiment run` and `pdcluster simulate` share them)."""

    file: Path
    out: Path
    force: bool
    only: list[str]
    dry_run: bool


def run(config: ExperimentRunConfig) -> int:
    """Runner of `pdcluster experiment run`: 0 when every cell ran (or was skipped), 1 if one failed."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return run_matrix(config, "pdcluster experiment")


def run_matrix(config: MatrixFlags, command: str, execute: Execute | None = None) -> int:
    """Load the experiment file, list (`--dry-run`) or run its unfinished cells by `execute` (the
    cluster's processes by default), print a summary: 0 when every cell ran, 1 if one failed, 2 for
    a refused file."""
    from pdcluster.experiment.load import ExperimentError, load_experiment
    from pdcluster.experiment.run import run_experiment, to_run

    try:
        experiment = load_experiment(config.file)
        plan = to_run(experiment, config.out, config.force)
    except (ExperimentError, ValueError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    if config.dry_run:
        for cell, must in plan:
            left_out = bool(config.only) and not any(o in cell.key for o in config.only)
            print(f"{'skip' if left_out else 'run ' if must else 'done'} {cell.key}")
        return 0
    result = run_experiment(experiment, config.out, config.force, config.only, execute=execute)
    states = [o.state for o in result.ran.values()]
    print(f"{command}: {states.count('done')} cells done, {states.count('failed')} failed, "
          f"{states.count('skipped')} skipped, {len(result.reused)} already finished; "
          f"report: {result.report}")
    return 1 if "failed" in states else 0


def report(config: ExperimentReportConfig) -> int:
    """Runner of `pdcluster experiment report`."""
    from pdcluster.experiment.report import write_report

    if not (config.out / "cells").is_dir():
        print(f"pdcluster experiment report: {config.out} has no cells/ folder", file=sys.stderr)
        return 2
    print(write_report(config.out))
    return 0
