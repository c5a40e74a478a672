"""When a launched cluster cannot come back: its Slurm allocation ended, or ssh reaches no node."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdcluster.cluster import launch as launch_module
from pdcluster.cluster.clusterfile import Via, parse
from pdcluster.cluster.launch import Launch, slurm_job_state
from pdcluster.cluster.processes import Proc

FILE = (
    '[model]\npath = "/m"\n'
    '[[nodes]]\naddress = "10.0.0.1"\nprefill = 1\n'
    '[[nodes]]\naddress = "10.0.0.2"\ndecode = 1\n'
)


@dataclass
class Ended:
    """A replica session that ended with these exit codes."""

    exits: list[int] = field(default_factory=list)
    running: bool = False


def launch(tmp_path: Path, via: Via, *exits: list[int]) -> Launch:
    made = Launch(parse(tmp_path / "c.toml", FILE), via)
    made.replicas = [Ended(e) for e in exits]  # type: ignore[misc]
    return made


def test_ssh_reaching_no_node_is_lost_one_reachable_is_not(tmp_path: Path) -> None:
    assert launch(tmp_path, Via.SSH, [255], [1, 255]).lost() == (
        "every node is unreachable (ssh exited with 255 for every replica)"
    )
    assert launch(tmp_path, Via.SSH, [255], [255, 1]).lost() == ""
    assert launch(tmp_path, Via.LOCAL, [255], [255]).lost() == ""


def gone(made: Launch) -> bool:
    """Whether the launch knows its steps are gone (read through a call: mypy keeps no narrowing)."""
    return made.allocation_gone


def test_an_allocation_that_ended_is_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    states = iter(["RUNNING", "CANCELLED", ""])
    monkeypatch.setattr(launch_module, "slurm_job_state", lambda job: next(states))
    made = launch(tmp_path, Via.SLURM, [0])
    assert made.lost() == "" and not gone(made)
    assert made.lost() == "the Slurm allocation 42 ended (CANCELLED)" and gone(made)
    assert made.lost() == "the Slurm allocation 42 ended (no longer known to Slurm)"


@pytest.mark.parametrize(
    ("rc", "out", "err", "state"),
    [
        (0, "RUNNING\n", "", "RUNNING"),
        (0, "COMPLETING\n", "", "COMPLETING"),
        (1, "", "slurm_load_jobs error: Invalid job id specified", ""),
        (1, "", "slurm_load_jobs error: Unable to contact slurm controller", None),  # unknown: not lost
    ],
)
def test_job_state_from_squeue(
    monkeypatch: pytest.MonkeyPatch, rc: int, out: str, err: str, state: str | None
) -> None:
    def squeue(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert argv == ["squeue", "-h", "-j", "7", "-o", "%T"]
        return subprocess.CompletedProcess(argv, rc, out, err)

    monkeypatch.setattr(launch_module.subprocess, "run", squeue)
    assert slurm_job_state("7") == state


def test_the_fake_stands_for_what_lost_reads() -> None:
    assert {"exits", "running"} <= set(dir(Proc)) | set(Proc.__dataclass_fields__)
