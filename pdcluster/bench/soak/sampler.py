"""Every `every` seconds: each cluster process's (and its children's) RSS, fds and threads, and each
replica's free KV pages from its Info RPC."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdcluster.bench.soak.probe import tree
from pdcluster.cluster.local import LocalCluster
from protos import generate_pb2 as gpb
from protos import generate_pb2_grpc as gpb_grpc


@dataclass
class Samples:
    """Rows of process usage and of replica pages, times in seconds since `t0` (monotonic)."""

    t0: float
    usage: list[dict[str, Any]] = field(default_factory=list)
    pages: list[dict[str, Any]] = field(default_factory=list)


def free_pages(address: str, timeout: float = 3.0) -> tuple[int, int] | None:
    """(free, total) KV pages of a replica (None: it did not answer)."""
    try:
        with grpc.insecure_channel(address) as channel:
            info = gpb_grpc.TextGenerationServiceStub(channel).Info(gpb.InfoRequest(), timeout=timeout)
    except grpc.RpcError:
        return None
    return info.num_blocks_free, info.num_blocks_total


def sample(cluster: LocalCluster, out: Samples) -> None:
    """One round of samples."""
    t = time.monotonic() - out.t0
    procs = [*([cluster.router] if cluster.router else []), *cluster.replicas]
    for proc in procs:
        for name, use in tree(proc.name, proc.popen.pid).items():
            out.usage.append({"t": t, "process": name, "pid": use.pid, "rss_mib": use.rss_mib,
                              "fds": use.fds, "threads": use.threads})
    for proc in cluster.replicas:
        pages = free_pages(proc.address)
        if pages is not None:
            out.pages.append({"t": t, "replica": proc.name, "free": pages[0], "total": pages[1]})


async def sample_loop(cluster: LocalCluster, out: Samples, until: float, every: float) -> None:
    """Sample now and every `every` s until `until` (monotonic), and once at the end."""
    while True:
        await asyncio.to_thread(sample, cluster, out)
        left = until - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(every, left))
