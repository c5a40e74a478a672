"""`pdcluster up --fabric`: tcp writes a table without a store; nccl/rdma/auto serve the rendezvous
store in the `up` process (it outlives every replica restart) and name it in the rank table."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.cluster.local import LocalCluster, UpConfig
from transfer.core import Deadline
from transfer.ranktable import load_rank_table
from transfer.store import StoreRendezvous, connect_store


@pytest.mark.parametrize("fabric", ["tcp", "cuda-ipc"])
def test_tcp_and_cuda_ipc_name_no_store(tmp_path: Path, fabric: str) -> None:
    args = LocalCluster(UpConfig(model=tmp_path, log_dir=tmp_path, fabric=fabric))._fabric_args([7001, 7002])
    assert args[2:] == ["--fabric", fabric] and load_rank_table(args[1]).store == ""


def test_cuda_ipc_refuses_a_node_per_replica(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cuda-ipc joins replicas on one host"):
        UpConfig(model=tmp_path, log_dir=tmp_path, fabric="cuda-ipc", link_gbps=10)


@pytest.mark.parametrize("fabric", ["nccl", "auto"])
def test_device_fabrics_get_a_served_store_in_the_table(tmp_path: Path, fabric: str) -> None:
    cluster = LocalCluster(UpConfig(model=tmp_path, log_dir=tmp_path, fabric=fabric))
    args = cluster._fabric_args([7001, 7002])
    assert args[2:] == ["--fabric", fabric]
    table = load_rank_table(args[1])
    assert table.store.startswith("127.0.0.1:")
    replica = StoreRendezvous(connect_store(table.store, timeout_s=5), rank=1)
    assert replica.incarnation == 1
    replica.publish("k", b"v")
    assert StoreRendezvous(connect_store(table.store, timeout_s=5)).lookup("k", Deadline.after(5)) == b"v"
