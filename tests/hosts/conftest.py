"""The `hosts` tier: emulated hosts (network + UTS namespaces, tc-shaped links) with real sshd, munged,
slurmctld and slurmd. Its set-up installs the Debian packages when they are missing (root and
apt-get); where that is impossible every test here skips with the reason."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.emulated_hosts import EmulatedHosts, emulated_hosts, require
from tests.helpers.emulated_slurm import start_slurm
from tests.helpers.host_checks import LINK
from tests.helpers.router_cluster import GreedyOracle


@pytest.fixture(scope="session")
def ssh_ready() -> None:
    """Packages for ssh hosts installed, namespaces possible (else skip, saying why)."""
    reason = require(slurm=False)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_ready(ssh_ready: None) -> None:
    """Packages for Slurm hosts too."""
    reason = require(slurm=True)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def kv_model(tiny_model_factory: Callable[..., Path]) -> Path:
    """A 40 M-parameter checkpoint with 64 KiB of KV per token (migrations long enough to time)."""
    return tiny_model_factory(
        layers=16, hidden=512, heads=8, kv_heads=8, intermediate=1024, max_positions=1024
    )


@pytest.fixture(scope="session")
def kv_oracle(kv_model: Path) -> GreedyOracle:
    """transformers' greedy output on `kv_model`."""
    return GreedyOracle(kv_model)


@pytest.fixture
def ssh_hosts(ssh_ready: None) -> Iterator[EmulatedHosts]:
    """Three hosts with sshd, 1 Gbit/s links; torn down after the test, also when it fails."""
    with emulated_hosts(3, rate=LINK) as hosts:
        yield hosts


@pytest.fixture
def slurm_hosts(slurm_ready: None) -> Iterator[EmulatedHosts]:
    """Three hosts with sshd and slurmd, slurmctld on the head node."""
    with emulated_hosts(3, rate=LINK) as hosts:
        start_slurm(hosts)
        yield hosts
