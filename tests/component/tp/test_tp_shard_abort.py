"""A worker's part of a KV migration (`ShardAbort`) or of a weight operation (`WeightAbort`) fails at
once when rank 0 aborts it, instead of waiting out its deadline: two tcp fabric endpoints on
loopback, the receiving worker's part posted with a long deadline, the sender never comes; the
abort makes it report UNAVAILABLE."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from replica.cluster import WEIGHT_BUFFER, KvLayout, ReplicaCluster
from replica.errors import PeerUnavailable
from replica.model.config import ModelConfig
from replica.model.layout import WeightLayout
from replica.params.store import ParamStore
from replica.params.transfer import WeightMover
from replica.tp.kvmove import ShardAbort, ShardEndpoint, ShardJob
from replica.tp.results import await_results, result_key
from replica.tp.weights import ReportingReadiness, WeightAbort, WeightEndpoint, WeightJob, WeightOp
from transfer.core import Deadline
from transfer.plans import OpKind
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
    job = ShardJob("j", OpKind.RECV, peers=(9, 0), regions=((0, 1024),), seconds=60.0, tag=7)
    endpoint.run(job)
    time.sleep(0.3)  # its receive is posted
    start = time.monotonic()
    endpoint.run(ShardAbort("j", "rank 0's part failed"))
    with pytest.raises(PeerUnavailable, match="tensor-parallel rank 1"):
        await_results(store, "j", 2, Deadline.after(10), "KV migration")
    assert time.monotonic() - start < 5  # not the job's 60 s


def test_an_aborted_weight_part_reports_at_once(clusters: list[ReplicaCluster], tmp_path: Path,
                                                tiny_model_factory: Callable[..., Path]) -> None:
    config = ModelConfig.from_dir(tiny_model_factory(arch="llama", layers=2))
    layout = WeightLayout.for_config(config, "float32")
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fabric = clusters[1].fabric
    fabric.register(WEIGHT_BUFFER, buffer)
    store = dist.HashStore()
    params = ParamStore(layout, buffer, ReportingReadiness(config.num_layers, store, 1), tmp_path)
    endpoint = WeightEndpoint(params, WeightMover(fabric, params, WEIGHT_BUFFER), store, tp=1, tp_rank=0)
    # tp 1 lists for the endpoint at global rank 1: receive from rank 0, which never sends
    endpoint.run(WeightJob("w", WeightOp.RECV, sources=(0,), seconds=60.0))
    time.sleep(0.3)
    start = time.monotonic()
    endpoint.run(WeightAbort("w", "rank 0's part failed"))
    key = result_key("w", 0)  # (this endpoint is tp_rank 0 of a tp 1 "group": read its report itself)
    while not store.check([key]):
        assert time.monotonic() - start < 5, "the aborted part did not report at once"
        time.sleep(0.02)
    assert store.get(key).decode().startswith("gone|")
