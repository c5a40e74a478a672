"""The cuda-ipc fabric's whole protocol (tickets, answers, cancels, producer marks, deadlines,
aborts, layouts) on its CPU backend (`SharedMemoryBackend`: numpy arrays play device memory, copies
run late on a worker thread), through the conformance suite and across two OS processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.transfer_conformance import CASES
from tests.helpers.transfer_fabrics import fabric_group, local_table, run_all, socket_fds, thread_names
from transfer.collectives import recv_regions, send_regions
from transfer.core import Deadline, Stream
from transfer.errors import PeerGone, PeerTimeout
from transfer.fabric import Fabric
from transfer.ipc.fabric import CudaIpcFabric
from transfer.ipc.shm import SharedMemoryBackend
from transfer.ports import free_ports
from transfer.ranktable import RankTable

ROOT = Path(__file__).resolve().parents[3]


def make_ipc_double(n: int, copy_delay_s: float = 0.0005, wait_for_producer: bool = True) -> list[Fabric]:
    """`n` cuda-ipc fabrics (control on tcp) whose numpy buffers are device memory."""
    table = local_table(n)
    return [CudaIpcFabric(table, r, backend=SharedMemoryBackend(copy_delay_s, wait_for_producer))
            for r in range(n)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_ipc_fabric_conformance_on_double(case: str) -> None:
    threads_before, sockets_before = thread_names(), socket_fds()
    CASES[case](make_ipc_double)
    leaked = thread_names() - threads_before
    assert not leaked, f"threads leaked: {leaked}"
    assert socket_fds() <= sockets_before, "sockets leaked"
