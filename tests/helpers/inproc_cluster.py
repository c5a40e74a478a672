"""In-process replicas sharing one rank table: the part the migration and weight helpers share.

    with inproc_cluster(model, tmp_path, 3, lambda rank: {"num_blocks": 64}) as replicas:
        replicas[1].stub.Info(...)

Each replica is what `serve()` runs (`replica.server.main.launch`): gRPC on 127.0.0.1 port 0, a
tcp fabric on loopback. `link_gbps` puts every rank on its own node with an emulated NIC of that
speed (paced transfers). `tests.helpers.migration_cluster` and `tests.helpers.weights_cluster`
build their clusters with it and add their own moves and checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdcluster.cluster.replica_process import free_ports, write_loopback_ranks
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from replica.config import ReplicaConfig
from replica.server.main import launch
from replica.server.weight_calls import WeightState

CALL_TIMEOUT = 60.0


@dataclass
class InProcReplica:
    """One in-process replica of the group: its rank, stub, channel and services."""

    rank: int
    stub: pb_grpc.TextGenerationServiceStub
    channel: grpc.Channel
    services: Any

    @property
    def weights(self) -> WeightState:
        """The replica's parameter store, guard and zigzag queue (white-box checks)."""
        state = self.services.core.weights.state
        assert state is not None
        return state

    def free_blocks(self) -> int:
        """Info.num_blocks_free."""
        return int(self.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).num_blocks_free)

    def total_blocks(self) -> int:
        """Info.num_blocks_total."""
        return int(self.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).num_blocks_total)

    def health(self) -> str:
        """Health.state."""
        return str(self.stub.Health(pb.HealthRequest(), timeout=CALL_TIMEOUT).state)


def write_rank_table(path: Path, n: int, link_gbps: float = 0.0) -> Path:
    """`n` loopback ranks; with `link_gbps` each rank is its own node behind an emulated NIC."""
    return write_loopback_ranks(path, free_ports(n), link_gbps, one_node=not link_gbps)


@contextlib.contextmanager
def inproc_cluster(
    model: Path, tmp_path: Path, n: int, config_for: Callable[[int], dict[str, Any]], link_gbps: float = 0.0
) -> Iterator[list[InProcReplica]]:
    """`n` replicas of `model` in this process, rank r configured by `config_for(r)`; stopped on exit."""
    table = write_rank_table(tmp_path / "ranks.json", n, link_gbps)
    replicas: list[InProcReplica] = []
    try:
        for rank in range(n):
            services = launch(
                ReplicaConfig(model=model, port=0, rank=rank, cluster=table, **config_for(rank))
            )
            channel = grpc.insecure_channel(f"127.0.0.1:{services.port}")
            replicas.append(
                InProcReplica(rank, pb_grpc.TextGenerationServiceStub(channel), channel, services)
            )
        yield replicas
    finally:
        for replica in replicas:
            replica.channel.close()
            replica.services.stop()
