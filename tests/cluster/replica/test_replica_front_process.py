"""The replica's gRPC front process: one child serving the port; if it dies the replica exits 1;
`--no-grpc-frontend` serves from the replica process itself."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import grpc

from pdcluster.cluster.replica_process import ReplicaProcess
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc

DEADLINE = 30.0


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _free_blocks(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        return stub.Info(pb.InfoRequest(), timeout=DEADLINE).num_blocks_free


def test_front_serves_and_its_death_stops_the_replica(tiny_model_factory: Callable[..., Path]) -> None:
    with ReplicaProcess.start(tiny_model_factory(arch="llama"), "--num-blocks", "16") as replica:
        assert _free_blocks(replica.address) == 16  # Info is forwarded by the front
        (front,) = _children(replica.process.pid)
        assert "replica.server.frontend" in Path(f"/proc/{front}/cmdline").read_text()
        os.kill(front, signal.SIGKILL)
        assert replica.process.wait(DEADLINE) == 1


def test_single_process_mode(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory(arch="llama")
    with ReplicaProcess.start(model, "--num-blocks", "16", "--no-grpc-frontend") as replica:
        assert _children(replica.process.pid) == []
        assert _free_blocks(replica.address) == 16
        assert replica.stop() == 0
