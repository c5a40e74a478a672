"""`pdcluster replica --tp N` processes sharing one rank table (each group's ranks contiguous in it),
for the per-rank migration and weight tests: start them, wait until they answer, stop them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdcluster.cluster.processes import pdcluster_argv
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from transfer.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60.0


@dataclass(frozen=True)
class Group:
    """What one replica process is started with: its rank 0's global rank and its tp size."""

    rank: int
    tp: int
    inactive: bool = False
    device: str = "cpu"  # rank 0's (`cuda:i`: its ranks take cuda:i .. cuda:i+tp-1)


@dataclass(frozen=True)
class Fabric:
    """The replicas' `--fabric` and the rank table's rendezvous store ("" = none; nccl / rdma need one)."""

    kind: str = "tcp"
    store: str = ""


@dataclass
class Proc:
    """One replica process: its rank, stub and gRPC address."""

    rank: int
    stub: pb_grpc.TextGenerationServiceStub
    address: str = ""

    async def pages(self) -> tuple[int, int]:
        """(total, free) KV pages, from Info (`router_core.pages_back` waits on it)."""
        info = await asyncio.to_thread(self.stub.Info, pb.InfoRequest(), timeout=TIMEOUT)
        return int(info.num_blocks_total), int(info.num_blocks_free)

    def check_all_free(self) -> None:
        """Every page is free (a sender frees its pages on its engine thread after answering: wait)."""
        deadline = time.monotonic() + 10
        while True:
            info = self.stub.Info(pb.InfoRequest(), timeout=TIMEOUT)
            held = info.num_blocks_total - info.num_blocks_free
            if held == 0:
                return
            assert time.monotonic() < deadline, f"rank {self.rank}: {held} pages still held"
            time.sleep(0.05)


def _start(model: Path, table: Path, group: Group, fabric: Fabric) -> tuple[subprocess.Popen[str], int]:
    port = free_ports(1)[0]
    on_device = ["--device", group.device, "--dtype", "float32"] if group.device != "cpu" else []
    argv = pdcluster_argv("replica", "--model", str(model), "--port", str(port), "--tp", str(group.tp),
                          "--num-blocks", "48", "--block-size", "4", "--tp-timeout", "20",
                          "--cluster", str(table), "--rank", str(group.rank), "--fabric", fabric.kind,
                          *on_device, *(["--inactive"] if group.inactive else []))
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return process, port


def _ready(stub: pb_grpc.TextGenerationServiceStub, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        try:
            stub.Info(pb.InfoRequest(), timeout=5)
            return
        except grpc.RpcError:
            time.sleep(0.3)
    raise AssertionError("a replica did not answer Info within 120 s")


def _device(group: Group, r: int) -> str:
    kind, _, index = group.device.partition(":")
    return f"{kind}:{int(index or 0) + r}" if kind == "cuda" else kind


def _rank_table(path: Path, groups: Sequence[Group], store: str = "") -> Path:
    """A loopback rank table of every group's ranks, contiguous, each worker rank's `tp_group` its
    group's rank 0."""
    ports = iter(free_ports(sum(g.tp for g in groups)))
    records = [{"rank": g.rank + r, "host": "127.0.0.1", "node": "n0", "device": _device(g, r),
                "transfer_address": f"127.0.0.1:{next(ports)}", **({"tp_group": g.rank} if r else {})}
               for g in groups for r in range(g.tp)]
    path.write_text(json.dumps({"ranks": records, **({"store": store} if store else {})}))
    return path


@contextlib.contextmanager
def tp_replicas(
    model: Path, tmp: Path, groups: Sequence[Group], fabric: Fabric | None = None
) -> Iterator[list[Proc]]:
    """The groups' processes (started at once, so they load in parallel), in `groups` order, on
    `fabric` (tcp without a store by default)."""
    fabric = fabric or Fabric()
    table = _rank_table(tmp / "ranks.json", groups, fabric.store)
    started = [_start(model, table, group, fabric) for group in groups]
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _, port in started]
    try:
        procs = []
        for group, (process, port), channel in zip(groups, started, channels, strict=True):
            stub = pb_grpc.TextGenerationServiceStub(channel)
            _ready(stub, process)
            procs.append(Proc(group.rank, stub, f"127.0.0.1:{port}"))
        yield procs
    finally:
        for channel in channels:
            channel.close()
        for process, _ in started:
            process.terminate()
        for process, _ in started:
            process.wait(timeout=60)
