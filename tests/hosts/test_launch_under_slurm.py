"""`pdcluster launch --via slurm` inside a real Slurm allocation (`salloc`; slurmctld on the head node,
one slurmd per emulated host): the same checks as over ssh, and `scancel` of the allocation stops
the launcher and its router within seconds, leaving nothing behind; with `[tls]` (mutual) and a
token file the staged files reach the hosts through `srun` as they do over ssh."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.emulated_hosts import EmulatedHosts
from tests.helpers.emulated_slurm import slurm_env
from tests.helpers.host_checks import (
    ROUTER_LINES,
    check_serving,
    check_tls_and_token,
    head_run,
    no_process_left,
    secure,
)
from tests.helpers.launched import Launched, NodeLine, pdcluster, write_cluster_file
from tests.helpers.router_cluster import GreedyOracle

pytestmark = pytest.mark.timeout(900)  # the first test of a session may install packages first


def launch_in_allocation(hosts: EmulatedHosts, model: Path, tls: bool = False) -> tuple[Launched, Path]:
    roles = ({"prefill": 1}, {"decode": 1}, {"decode": 1})
    nodes = [NodeLine(h.name, h.address, r) for h, r in zip(hosts.hosts, roles, strict=True)]
    file = write_cluster_file(
        hosts.folder / "cluster.toml", model, nodes, "ssh", hosts.head_address, router=ROUTER_LINES
    )
    if tls:
        secure(hosts, file)
    argv = [
        "ip",
        "netns",
        "exec",
        hosts.head,
        "salloc",
        f"--nodes={len(hosts.hosts)}",
        "--overcommit",
        *pdcluster("launch", str(file), "--via", "slurm"),
    ]
    return Launched(argv, env=slurm_env(hosts)), file


def job_id(hosts: EmulatedHosts) -> str:
    out = subprocess.run(
        ["ip", "netns", "exec", hosts.head, "squeue", "-h", "-o", "%i"],
        capture_output=True,
        text=True,
        env=slurm_env(hosts),
        timeout=30,
        check=True,
    ).stdout.split()
    assert len(out) == 1, out
    return out[0]


def test_slurm_launch_serves_migrates_lists_and_leaves_nothing(
    slurm_hosts: EmulatedHosts, kv_model: Path, kv_oracle: GreedyOracle
) -> None:
    launched, file = launch_in_allocation(slurm_hosts, kv_model)
    try:
        ratio = check_serving(slurm_hosts, launched, file, kv_model, kv_oracle, env=slurm_env(slurm_hosts))
        print(f"\nmigration time / (bytes / 1 Gbit/s) = {ratio:.3f}; launch: {launched.stderr}")
        record = json.loads((file.parent / "logs" / "run.json").read_text())
        assert record["via"] == "slurm" and record["slurm_job"] == job_id(slurm_hosts)
        down = head_run(slurm_hosts, "down", str(file), env=slurm_env(slurm_hosts))
        assert down.returncode == 0, down.stdout + down.stderr
        assert launched.wait(60) == 0  # salloc ends with its command's exit code
        no_process_left(slurm_hosts)
    finally:
        launched.kill()


def test_scancel_stops_the_launch_and_its_router(slurm_hosts: EmulatedHosts, kv_model: Path) -> None:
    launched, file = launch_in_allocation(slurm_hosts, kv_model)
    try:
        launched.ready(240)
        job = job_id(slurm_hosts)
        cancelled = time.monotonic()
        subprocess.run(
            ["ip", "netns", "exec", slurm_hosts.head, "scancel", job],
            env=slurm_env(slurm_hosts),
            timeout=30,
            check=True,
        )
        assert launched.wait(30) != 0
        assert time.monotonic() - cancelled < 15, launched.stderr
        assert f"the Slurm allocation {job} ended" in launched.stderr
        no_process_left(slurm_hosts)
        record = json.loads((file.parent / "logs" / "run.json").read_text())
        assert record["phase"] == "failed" and "allocation" in record["message"]
        assert head_run(slurm_hosts, "status", str(file), env=slurm_env(slurm_hosts)).returncode == 3
    finally:
        launched.kill()


def test_slurm_launch_with_mutual_tls_and_a_token(
    slurm_hosts: EmulatedHosts, tiny_model_factory: Callable[..., Path]
) -> None:
    model = tiny_model_factory()
    launched, file = launch_in_allocation(slurm_hosts, model, tls=True)
    try:
        check_tls_and_token(slurm_hosts, launched, file, model, env=slurm_env(slurm_hosts))
        down = head_run(slurm_hosts, "down", str(file), env=slurm_env(slurm_hosts))
        assert down.returncode == 0 and launched.wait(60) == 0, down.stdout + down.stderr
        no_process_left(slurm_hosts)
    finally:
        launched.kill()
