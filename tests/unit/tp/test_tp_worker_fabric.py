"""Which fabric a worker rank opens: the replica's `--fabric` (tcp staged for CUDA buffers, auto as a
replica resolves it), passed on its command line; a device fabric refused for host buffers before
anything opens; a tcp endpoint opened on the rank's table entry. (Device fabrics themselves:
tests/gpu/test_tp_device_moves.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replica.tp.fabric import choose_worker_fabric, open_worker_cluster
from replica.tp.leader import Endpoints, worker_command
from replica.tp.rank import RankSpec
from transfer.core import Rank
from transfer.errors import FabricUnavailable
from transfer.fabric import FabricKind
from transfer.ports import free_ports
from transfer.ranktable import RankEntry, RankTable


def _table(nodes: tuple[str, ...] = ("n0", "n0")) -> RankTable:
    ports = free_ports(len(nodes))
    return RankTable(tuple(
        RankEntry(Rank(r), "127.0.0.1", node, "cpu", f"127.0.0.1:{port}", tp_group=0 if r else None)
        for r, (node, port) in enumerate(zip(nodes, ports, strict=True))
    ))


@pytest.mark.parametrize(("choice", "devices", "kind", "staged"), [
    ("tcp", ("cpu", "cpu"), FabricKind.TCP, False),
    ("tcp", ("cuda", "cuda"), FabricKind.TCP, True),  # device buffers through host memory
    ("auto", ("cpu", "cpu"), FabricKind.TCP, False),
    ("auto", ("cuda", "cuda"), FabricKind.CUDA_IPC, False),  # every rank on this node
    ("nccl", ("cuda", "cuda"), FabricKind.NCCL, False),
    ("rdma", ("cuda", "cuda"), FabricKind.RDMA, False),
    ("cuda-ipc", ("cuda", "cuda"), FabricKind.CUDA_IPC, False),
])
def test_a_worker_takes_the_replicas_fabric(choice: str, devices: tuple[str, str], kind: FabricKind,
                                            staged: bool) -> None:
    chosen = choose_worker_fabric(choice, _table(), 1, devices)
    assert (chosen.kind, chosen.staged) == (kind, staged)


def test_the_fabric_goes_on_the_workers_command_line(tmp_path: Path) -> None:
    endpoints = Endpoints(tmp_path / "ranks.json", 4, "nccl")
    argv = worker_command(RankSpec(tmp_path, torch.float32, 8, 4, "torch"), 1, 2, "127.0.0.1:1",
                          torch.device("cuda:0"), 5.0, endpoints)
    assert argv[argv.index("--fabric") + 1] == "nccl"
    assert argv[argv.index("--transfer-rank") + 1] == "5"
    assert Endpoints(tmp_path, 0).fabric == "tcp"  # the default, as the replica's --fabric


def test_a_device_fabric_for_host_buffers_is_refused_before_anything_opens() -> None:
    cache = torch.zeros(4)
    with pytest.raises(FabricUnavailable, match="fabric nccl moves CUDA memory"):
        open_worker_cluster("nccl", _table(), 1, cache, cache)


def test_a_tcp_endpoint_opens_on_the_workers_table_entry() -> None:
    table, cache = _table(), torch.zeros(4)
    cluster = open_worker_cluster("auto", table, 1, cache, cache)
    try:
        assert (cluster.kind, cluster.rank) == ("tcp", 1)
    finally:
        cluster.close()
