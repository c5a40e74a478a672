"""The processes of `pdcluster bench transfer`: our fabric, the raw-socket ceilings, and gloo.

Each function runs in its own (spawned) process, waits on the shared start barrier, times its part
with `time.monotonic()` (one clock for every process on Linux) and puts a result dict on `results`.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer.collectives import (
    TransferOptions,
    chain_broadcast,
    recv_regions,
    ring_allgather,
    send_regions,
    tanz_broadcast,
)
from transfer.core import Deadline, Stream
from transfer.ranktable import RankTable
from transfer.tcp.fabric import TcpFabric


@dataclass(frozen=True)
class Job:
    """What one benchmark process does (picklable, sent to spawned processes)."""

    kind: str  # "ours", "raw", "gloo_p2p", "gloo_broadcast", "gloo_allgather"
    algo: str
    rank: int
    order: tuple[int, ...]  # chain order, ring order, or sources + dests for Tanz
    sources: int
    size: int
    chunk: int
    stripe: int
    region: int
    link_gbps: float
    repeats: int
    table_json: str
    port: int  # gloo rendezvous port
    scatter: bool = False  # receivers put the regions in reverse order (KV-migration shape)


def _pattern(size: int) -> np.ndarray:
    """Byte i is i % 251, built in uint8 (an arange of uint32 would take 8x `size` of memory at peak,
    and nine ranks verifying 256 MiB at once ran the machine out of memory)."""
    return np.resize(np.arange(251, dtype=np.uint8), size)


def _holds_initially(job: Job) -> bool:
    if job.algo == "tanz":
        return job.rank in job.order[: job.sources]
    if job.algo == "ring":
        return True  # each rank holds its stripe; filling all of it changes nothing in the timing
    return job.rank == job.order[0]


def run_ours(job: Job, barrier: Any, results: Any, progress: Any) -> None:
    """Our TCP fabric running the chosen collective `repeats` times."""
    table = RankTable.from_records(json.loads(job.table_json)["ranks"])
    fabric = TcpFabric(table, job.rank, inter_node_gbps=job.link_gbps)
    buf = _pattern(job.size) if _holds_initially(job) else np.zeros(job.size, np.uint8)
    fabric.register("w", buf)
    sender_regions = [(o, min(job.region, job.size - o)) for o in range(0, job.size, job.region)]
    regions = sender_regions
    if job.scatter and not _holds_initially(job):
        regions = _reversed_layout(sender_regions, job.size)
    options = TransferOptions(chunk_bytes=job.chunk, stripe_bytes=job.stripe)
    times: list[float] = []
    try:
        for attempt in range(job.repeats + 1):  # attempt 0 connects everything and warms up
            barrier.wait()
            start = time.monotonic()
            tagged = dataclasses.replace(options, tag=attempt)
            _collective(fabric, job, regions, tagged, progress if attempt == job.repeats else None)
            times.append(time.monotonic() - start)
            barrier.wait()
        sample = slice(None, None, 4099)
        expected = _pattern(job.size)
        if job.scatter:
            expected = np.concatenate([expected[o : o + n] for o, n in reversed(sender_regions)])
        ok = _holds_initially(job) or bool(np.array_equal(buf[sample], expected[sample]))
    finally:
        fabric.close()
    results.put({"kind": "ours", "rank": job.rank, "times": times[1:], "ok": ok})


def _reversed_layout(regions: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The same region lengths, laid out back to front (every region lands at another offset)."""
    out, end = [], size
    for _, length in regions:
        out.append((end - length, length))
        end -= length
    return out


class _Progress:
    """Counts landed regions and reports them to the parent at most every 50 ms (a queue put per
    region would cost more than the transfer of a small region)."""

    def __init__(self, queue: Any) -> None:
        self.queue, self.count, self.last = queue, 0, time.monotonic()

    def __call__(self, index: int) -> None:
        self.count += 1
        if time.monotonic() - self.last > 0.05:
            self.flush()

    def flush(self) -> None:
        if self.count:
            self.queue.put(self.count)
        self.count, self.last = 0, time.monotonic()


def _collective(fabric: TcpFabric, job: Job, regions: list[tuple[int, int]], options: TransferOptions,
                progress: Any) -> None:
    deadline = Deadline.after(600)
    on_region = _Progress(progress) if progress is not None else None
    try:
        _run_algo(fabric, job, regions, options, deadline, on_region)
    finally:
        if on_region is not None:
            on_region.flush()


def _run_algo(fabric: TcpFabric, job: Job, regions: list[tuple[int, int]], options: TransferOptions,
              deadline: Deadline, on_region: Any) -> None:
    if job.algo == "p2p":
        if job.rank == job.order[0]:
            send_regions(fabric, job.order[1], "w", regions, Stream.PARAMS, deadline, None, options)
        else:
            recv_regions(fabric, job.order[0], "w", regions, Stream.PARAMS, deadline, on_region, options)
    elif job.algo == "chain":
        chain_broadcast(fabric, list(job.order), "w", regions, Stream.PARAMS, deadline, on_region, options)
    elif job.algo == "tanz":
        sources, dests = list(job.order[: job.sources]), list(job.order[job.sources :])
        tanz_broadcast(fabric, sources, dests, "w", regions, Stream.PARAMS, deadline, on_region, options)
    else:
        ring_allgather(fabric, list(job.order), "w", regions, Stream.PARAMS, deadline, on_region, options)


def run_raw(job: Job, barrier: Any, results: Any, ports: list[int]) -> None:
    """A minimal raw-socket relay chain (p2p when two ranks): recv_into a chunk, sendall it on."""
    index = job.order.index(job.rank)
    last = index == len(job.order) - 1
    listener = socket.create_server(("127.0.0.1", ports[index])) if index else None
    barrier.wait()  # everyone listens
    out = socket.create_connection(("127.0.0.1", ports[index + 1])) if not last else None
    inp = listener.accept()[0] if listener is not None else None
    buf = _pattern(job.size) if index == 0 else np.zeros(job.size, np.uint8)
    view = memoryview(buf.data)
    times = []
    for _ in range(job.repeats):
        barrier.wait()
        start = time.monotonic()
        _relay(view, job.chunk, inp, out)
        times.append(time.monotonic() - start)
    for sock in (out, inp, listener):
        if sock is not None:
            sock.close()
    results.put({"kind": "raw", "rank": job.rank, "times": times, "ok": True})


def _relay(view: memoryview, chunk: int, inp: socket.socket | None, out: socket.socket | None) -> None:
    for offset in range(0, len(view), chunk):
        piece = view[offset : offset + chunk]
        if inp is not None:
            got = 0
            while got < len(piece):
                got += inp.recv_into(piece[got:])
        if out is not None:
            out.sendall(piece)
    if inp is not None:
        inp.sendall(b"k")  # acknowledge, so the sender's time covers delivery
    if out is not None:
        out.recv(1)


def run_gloo(job: Job, barrier: Any, results: Any) -> None:
    """torch.distributed (gloo) send/recv, broadcast or all-gather of the same bytes."""
    import torch
    import torch.distributed as dist

    world = len(job.order)
    me = job.order.index(job.rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port}", world_size=world, rank=me)
    tensor = torch.from_numpy(_pattern(job.size) if me == 0 else np.zeros(job.size, np.uint8))
    times = []
    for _ in range(job.repeats):
        dist.barrier()
        start = time.monotonic()
        if job.kind == "gloo_p2p":
            if me == 0:
                dist.send(tensor, dst=1)
            elif me == 1:
                dist.recv(tensor, src=0)
        elif job.kind == "gloo_broadcast":
            dist.broadcast(tensor, src=0)
        else:
            stripe = job.size // world
            parts = [torch.empty(stripe, dtype=torch.uint8) for _ in range(world)]
            dist.all_gather(parts, tensor[me * stripe : (me + 1) * stripe].clone())
        dist.barrier()
        times.append(time.monotonic() - start)
    dist.destroy_process_group()
    results.put({"kind": job.kind, "rank": job.rank, "times": times, "ok": True})
