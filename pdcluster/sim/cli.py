"""`pdcluster simulate FILE --out DIR`: an experiment file's matrix in virtual time (config and runner)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SimulateConfig:
    """Flags of `pdcluster simulate`."""

    file: Path = field(metadata={"help": "experiment file (TOML); its clusters need engine = \"simulated\"",
                                 "positional": True})
    out: Path = field(metadata={"help": "output folder: one folder per cell, report.md, plots/"})
    force: bool = field(default=False, metadata={"help": "run finished cells again"})
    only: list[str] = field(default_factory=list, metadata={
        "help": "run only the cells whose folder name contains one of these strings"})
    dry_run: bool = field(default=False, metadata={"help": "list the cells and whether each would run"})


def run(config: SimulateConfig) -> int:
    """Runner of `pdcluster simulate`: 0 when every cell ran, 1 if one failed, 2 for a refused file."""
    from pdcluster.experiment.cli import run_matrix
    from pdcluster.sim.cell import execute

    return run_matrix(config, "pdcluster simulate", execute)
