"""Two replicas' fabrics built by `build_cluster` on `--fabric cuda-ipc`, on the CPU: the ipc fabric's
shared-memory backend (numpy arrays play device memory) is passed as the device fabric's `backend`,
everything else is the replica's own path (rank table file, KV check, control tcp, registration)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from replica.cluster import KV_BUFFER, ReplicaCluster, build_cluster, device_fabric_options
from replica.config import EngineKind
from tests.helpers.transfer_fabrics import local_table
from transfer.core import Deadline, Stream
from transfer.errors import FabricUnavailable
from transfer.fabric import FabricKind
from transfer.ipc.fabric import CudaIpcFabric
from transfer.ipc.shm import SharedMemoryBackend
from transfer.ranktable import RankTable

PAGES, PAGE = 4, 64


def _config(ranks: Path, rank: int) -> Any:
    return SimpleNamespace(cluster=ranks, rank=rank, host="127.0.0.1", engine=EngineKind.TORCH, scale=1.0,
                           fabric="cuda-ipc")


def _engine(kv: np.ndarray) -> Any:
    cache = SimpleNamespace(tensor=kv, block_size=16, num_kv_heads=2, head_dim=8, dtype="uint8", num_layers=2)
    return SimpleNamespace(runner=SimpleNamespace(cache=cache))


def _replica(ranks: Path, rank: int, kv: np.ndarray, backend: SharedMemoryBackend) -> ReplicaCluster:
    weights = np.zeros(256, np.uint8)
    return build_cluster(_config(ranks, rank), 50000 + rank, _engine(kv), weights, backend=backend)


def test_two_replicas_on_cuda_ipc_move_kv_device_to_device_and_headers_on_tcp(tmp_path: Path) -> None:
    ranks = tmp_path / "ranks.json"
    ranks.write_text(local_table(2).to_json())
    backends = [SharedMemoryBackend(copy_delay_s=0.0005) for _ in range(2)]
    kvs = [b.allocate(PAGES * PAGE) for b in backends]
    kvs[0][:] = np.arange(PAGES * PAGE) % 251
    replicas = [_replica(ranks, r, kvs[r], backends[r]) for r in (0, 1)]
    try:
        assert all(isinstance(r.fabric, CudaIpcFabric) for r in replicas)  # neither staged nor split
        assert not any(r.unmovable for r in replicas)
        deadline = Deadline.after(20)
        # pages 1 and 3 of replica 0 into pages 0 and 2 of replica 1: device to device
        sent = replicas[0].fabric.send(1, KV_BUFFER, [(PAGE, PAGE), (3 * PAGE, PAGE)], Stream.KV, deadline)
        into_pages = [(0, PAGE), (2 * PAGE, PAGE)]
        replicas[1].fabric.recv(0, KV_BUFFER, into_pages, Stream.KV, deadline).wait(deadline)
        sent.wait(deadline)
        assert kvs[1][:PAGE].tolist() == kvs[0][PAGE:2 * PAGE].tolist()
        assert kvs[1][2 * PAGE:3 * PAGE].tolist() == kvs[0][3 * PAGE:].tolist()
        # a migration header (host memory) on the same fabric: its control tcp carries it
        header, into = bytearray(b"header"), bytearray(6)
        replicas[0].fabric.register("h", header)
        replicas[1].fabric.register("h", into)
        sent = replicas[0].fabric.send(1, "h", [(0, 6)], Stream.KV, deadline)
        replicas[1].fabric.recv(0, "h", [(0, 6)], Stream.KV, deadline).wait(deadline)
        sent.wait(deadline)
        assert into == header
    finally:
        for replica in replicas:
            replica.close()


class _CudaTensor:
    """Stands in for a CUDA KV cache (torch's device type names it CUDA)."""

    __module__ = "torch.fake"
    untyped_storage = None
    device = type("Device", (), {"type": "cuda", "index": 0})()


def test_cuda_ipc_refuses_host_kv_and_ranks_on_two_nodes_in_one_line() -> None:
    table = local_table(2)
    with pytest.raises(FabricUnavailable, match="KV cache is in cpu memory: start it with --device cuda"):
        device_fabric_options(FabricKind.CUDA_IPC, table, 0, np.zeros(8, np.uint8), {})
    two_nodes = RankTable((table[0], dataclasses.replace(table[1], node="n1")))
    with pytest.raises(FabricUnavailable, match=r"one host, .* on n0 and n1: use --fabric nccl") as caught:
        device_fabric_options(FabricKind.CUDA_IPC, two_nodes, 0, _CudaTensor(), {})
    assert "\n" not in str(caught.value)
    options = device_fabric_options(FabricKind.CUDA_IPC, table, 0, _CudaTensor(), {"inter_node_gbps": 5.0})
    assert options == {"control_options": {"inter_node_gbps": 5.0}}  # no store: handles go on the control
