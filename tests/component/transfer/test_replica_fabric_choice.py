"""The replica's fabric at start: `--fabric nccl|rdma` builds a `SplitFabric` through the rank
table's store (or fails with one line saying what is missing), `auto` picks by device and nodes."""

from __future__ import annotations

import dataclasses
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdcluster.cluster.processes import pdcluster_argv
from replica.cluster import device_fabric_options, open_fabric, resolve_fabric
from replica.errors import InvalidArgument
from replica.links import WARM_STREAMS, connect_peers
from tests.helpers.transfer_fabrics import local_table
from tests.helpers.transfer_nccl_double import DoubleBackend, DoubleWorld
from transfer.composite import SplitFabric
from transfer.core import Deadline
from transfer.errors import FabricUnavailable
from transfer.fabric import FabricKind, choose_fabric
from transfer.ranktable import RankTable
from transfer.store import StoreUnreachable, connect_store, serve_store
from transfer.tcp.fabric import TcpFabric

ROOT = Path(__file__).resolve().parents[3]


class _CudaTensor:
    """Stands in for the KV cache tensor: torch's device type names it CUDA."""

    __module__ = "torch.fake"
    untyped_storage = None
    device = type("Device", (), {"type": "cuda", "index": 1})()


def test_replica_with_nccl_on_cpu_exits_with_one_line(tiny_llama: Path) -> None:
    argv = pdcluster_argv("replica", "--model", str(tiny_llama), "--port", "0", "--fabric", "nccl")
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if "fabric nccl" in line]
    assert len(lines) == 1 and "--device cuda" in lines[0], out.stderr[-2000:]


def test_nccl_without_a_store_or_with_an_unreachable_one_fails_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import replica.cluster

    monkeypatch.setattr(replica.cluster, "connect_store", partial(connect_store, timeout_s=0.5))
    table = local_table(2)
    with pytest.raises(FabricUnavailable, match="rendezvous store"):
        device_fabric_options(FabricKind.NCCL, table, 0, _CudaTensor(), {})
    from transfer.ports import free_ports

    gone = RankTable(table.entries, store=f"127.0.0.1:{free_ports(1)[0]}")
    with pytest.raises(StoreUnreachable):  # a FabricUnavailable too: the replica prints one line
        device_fabric_options(FabricKind.NCCL, gone, 0, _CudaTensor(), {})


def test_nccl_replicas_get_split_fabrics_that_meet_through_the_store() -> None:
    server, address = serve_store()
    table, world = dataclasses.replace(local_table(2), store=address), DoubleWorld()
    options = [device_fabric_options(FabricKind.NCCL, table, r, _CudaTensor(), {}) for r in (0, 1)]
    assert options[0]["device"] == 1 and options[0]["rendezvous"].incarnation == 1
    fabrics: list[Any] = [open_fabric("nccl", table, r, backend=DoubleBackend(world), **options[r])
                          for r in (0, 1)]
    try:
        assert all(isinstance(f, SplitFabric) for f in fabrics)
        src, dst = np.arange(16, dtype=np.uint8), np.zeros(16, np.uint8)
        # a bytearray header on the control fabric (tcp) ...
        fabrics[0].register("h", bytearray(b"hdr"))
        fabrics[1].register("h", bytearray(3))
        deadline = Deadline.after(20)
        sent = fabrics[0].send(1, "h", [(0, 3)], 1, deadline)
        fabrics[1].recv(0, "h", [(0, 3)], 1, deadline).wait(deadline)
        sent.wait(deadline)
        # ... and device memory (numpy stands in, routed by hand) on NCCL through the store
        for fabric, buf in zip(fabrics, (src, dst), strict=True):
            fabric.bulk.register("kv", buf)
            fabric._routes["kv"] = fabric.bulk
        sent = fabrics[0].send(1, "kv", [(0, 16)], 1, deadline)
        fabrics[1].recv(0, "kv", [(0, 16)], 1, deadline).wait(deadline)
        sent.wait(deadline)
        assert dst.tolist() == src.tolist()
    finally:
        for fabric in fabrics:
            fabric.close()
        del server


def test_auto_picks_a_device_fabric_only_for_cuda_buffers_across_nodes() -> None:
    every = lambda module: True  # noqa: E731
    assert choose_fabric(True, True, True, every) is FabricKind.RDMA
    assert choose_fabric(True, True, False, every) is FabricKind.NCCL
    assert choose_fabric(True, True, True, lambda m: m == "cupy") is FabricKind.NCCL
    assert choose_fabric(True, True, False, lambda m: False) is FabricKind.TCP
    assert choose_fabric(True, False, True, every) is FabricKind.CUDA_IPC  # one node: device to device
    assert choose_fabric(False, True, True, every) is FabricKind.TCP  # host buffers: tcp
    one_node = local_table(2)
    assert resolve_fabric("auto", one_node, 0, ("cuda", "cuda")) is FabricKind.CUDA_IPC
    assert resolve_fabric("auto", one_node, 0, ("cpu", "cpu")) is FabricKind.TCP
    assert resolve_fabric("nccl", one_node, 0, ("cpu",)) is FabricKind.NCCL
    two_nodes = RankTable((one_node[0], dataclasses.replace(one_node[1], node="n1")))
    assert resolve_fabric("auto", two_nodes, 0, ("cpu", "cpu")) is FabricKind.TCP


def test_connect_peers_reports_a_peer_it_cannot_reach_instead_of_failing() -> None:

    table = local_table(3)  # rank 2 never starts
    fabrics = [TcpFabric(table, 0, refused_grace_s=0.3), TcpFabric(table, 1)]
    try:
        links = connect_peers(fabrics[0], table, 0, [2, 1], Deadline.after(5))
        assert [link.rank for link in links] == [2, 1]
        assert links[1].error == "" and "PeerGone" in links[0].error
        assert all(fabrics[0]._out(1, s)._sock is not None for s in WARM_STREAMS)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match=r"\[0\]"):
            connect_peers(fabrics[0], table, 0, [0], Deadline.after(5))
    finally:
        for fabric in fabrics:
            fabric.close()
