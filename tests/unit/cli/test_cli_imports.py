"""The CLI imports only the chosen subcommand's modules: `pdcluster devices` runs on a bare GPU node
where torch, grpc, fastapi, matplotlib or transformers cannot be imported, and `pdcluster replica
--help` does not import torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster import SOURCE_ROOT
from pdcluster.cli.commands import COMMANDS
from pdcluster.cli.main import _path_of, resolve

BLOCKED = ("torch", "grpc", "fastapi", "matplotlib", "transformers")

# Installed as sitecustomize.py: every import of a blocked package (or a module inside it) fails, as on
# a node where it is not installed.
BLOCKER = f"""
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocker())
"""


def run_blocked(tmp_path: Path, *args: str, probe: str = "") -> subprocess.CompletedProcess[str]:
    """`python -m pdcluster ARGS` with the blocker installed; `probe`: Python run after main() instead."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SOURCE_ROOT)])}
    argv = [sys.executable, "-c", probe] if probe else [sys.executable, "-m", "pdcluster", *args]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                          check=False)


def test_the_blocker_blocks(tmp_path: Path) -> None:
    done = run_blocked(tmp_path, probe="import grpc")
    assert done.returncode != 0 and "blocked by the test" in done.stderr


@pytest.mark.parametrize("args", [["devices"], ["devices", "--json"], ["devices", "--help"]])
def test_devices_runs_without_torch_grpc_fastapi_matplotlib_transformers(tmp_path: Path, args: list[str]
                                                                        ) -> None:
    done = run_blocked(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert ("usage: pdcluster devices" in done.stdout) if "--help" in args else ("cpu cores" in done.stdout
                                                                                or '"cpus"' in done.stdout)


def test_replica_help_imports_no_torch(tmp_path: Path) -> None:
    probe = ("import contextlib, io, sys\nfrom pdcluster.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out:\n    rc = main(['replica', '--help'])\n"
             "assert rc == 0 and '--device' in out.getvalue(), rc\n"
             "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'grpc', 'router'})\n"
             "print('loaded', loaded)")
    done = run_blocked(tmp_path, probe=probe)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded []"


def test_every_command_names_its_config_where_it_is_defined() -> None:
    """The CLI matches a parsed config to its command by "module:name" without importing the other
    commands: each path must be the class's own."""
    for command in COMMANDS.values():
        assert _path_of(resolve(command.config)) == command.config
