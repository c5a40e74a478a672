"""`pdcluster simulate FILE --out DIR`: an experiment file's matrix in virtual time (config and runner)."""

from __future__ import annotations

import sys
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
    from pdcluster.experiment.load import ExperimentError, load_experiment
    from pdcluster.experiment.run import run_experiment, to_run
    from pdcluster.sim.cell import execute

    try:
        experiment = load_experiment(config.file)
        plan = to_run(experiment, config.out, config.force)
    except (ExperimentError, ValueError) as exc:
        print(f"pdcluster simulate: {exc}", file=sys.stderr)
        return 2
    if config.dry_run:
        for cell, must in plan:
            print(f"{'run ' if must else 'done'} {cell.key}")
        return 0
    result = run_experiment(experiment, config.out, config.force, config.only, execute=execute)
    states = [o.state for o in result.ran.values()]
    print(f"pdcluster simulate: {states.count('done')} cells done, {states.count('failed')} failed, "
          f"{len(result.reused)} already finished; report: {result.report}")
    return 1 if "failed" in states else 0
