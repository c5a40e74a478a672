"""A worker's part of a KV migration fails at once when rank 0 aborts it (`ShardAbort`), instead of
waiting out the migration's deadline: two tcp fabric endpoints on loopback, the receiving worker's
part posted with a long deadline, the sender never comes; the abort makes it report UNAVAILABLE."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from replica.cluster import KvLayout, ReplicaCluster
from replica.errors import PeerUnavailable
from replica.tp.kvmove import Direction, ShardAbort, ShardEndpoint, ShardJob
from replica.tp.results import await_results
from transfer.core import Deadline
from transfer.ports import free_ports
from transfer.ranktable import RankTable

LAYOUT = KvLayout(block_size=4, num_kv_heads=1, head_dim=8, dtype="float32", num_layers=1, tp_size=2)


@pytest.fixture
def clusters() -> Iterator[list[ReplicaCluster]]:
    table = RankTable.local(free_ports(2))
    made = [ReplicaCluster.start("tcp", table, rank, "") for rank in (0, 1)]
    for cluster in made:
        cluster.register_kv(torch.zeros(4096, dtype=torch.uint8), LAYOUT)
    yield made
    for cluster in made:
        cluster.close()


def test_an_aborted_part_reports_at_once(clusters: list[ReplicaCluster]) -> None:
    store = dist.HashStore()
    endpoint = ShardEndpoint(clusters[1], store, tp_rank=1)  # tp_rank 1 at global rank 1; peer: 0
    job = ShardJob("j", Direction.RECV, peers=(9, 0), regions=((0, 1024),), seconds=60.0, tag=7)
    endpoint.run(job)
    time.sleep(0.3)  # its receive is posted
    start = time.monotonic()
    endpoint.run(ShardAbort("j", "rank 0's part failed"))
    with pytest.raises(PeerUnavailable, match="tensor-parallel rank 1"):
        await_results(store, "j", 2, Deadline.after(10), "KV migration")
    assert time.monotonic() - start < 5  # not the job's 60 s
