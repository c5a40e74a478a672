"""The two processes of `pdcluster bench gpu-transfer`, and the device copy it compares against.

Rank 0 sends, rank 1 receives, for each leg in turn (`gpu_transfer.legs`): both wait on the shared
barrier, time `repeats` transfers after one warm-up (which connects and opens everything) with
`time.monotonic()`, and put their times on `results`; rank 1 also checks every byte once. Rank 0
then times the device-to-device copies of the same bytes. On `cuda` the buffers are CUDA tensors
(cuda-ipc: torch's IPC; staged tcp: pinned host slots); on `cpu` the cuda-ipc legs run on the
fabric's CPU backend (`SharedMemoryBackend`: shared-memory numpy arrays play device memory) and the
staged leg carries host memory (nothing to stage), so the run checks the protocol and the report,
not GPU figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from transfer.collectives import TransferOptions, recv_regions, send_regions
from transfer.core import Deadline, Segments, Stream
from transfer.fabric import Fabric
from transfer.ranktable import RankTable

PATTERN = 251  # byte i of a source is i % 251: a page moved to the wrong place shows


@dataclass(frozen=True)
class LegSpec:
    """One measured transfer: which fabric, which buffer, the regions on each side."""

    name: str
    fabric: str  # "ipc" | "staged" | "tcp"
    buffer: str  # "kv" | "weights"
    send: Segments
    recv: Segments


@dataclass(frozen=True)
class RankJob:
    """What one process does (picklable for spawned processes)."""

    rank: int
    device: str  # "cuda" | "cpu"
    legs: tuple[LegSpec, ...]
    sizes: dict[str, int]  # buffer name -> bytes
    ports: dict[str, tuple[int, int]]  # fabric -> both ranks' ports
    chunk: int
    repeats: int
    timeout_s: float


def run_rank(job: RankJob, barrier: Any, results: Any) -> None:
    """Every leg of `job` (the module docstring); rank 0 also times the device copies."""
    memory = _Memory(job.device)
    fabrics: dict[str, Fabric] = {}
    try:
        record: dict[str, Any] = {"rank": job.rank, "times": {}, "ok": True, "copies": {}}
        for leg in job.legs:
            if leg.fabric not in fabrics:
                fabrics[leg.fabric] = _fabric(job, leg.fabric, memory)
            fabric = fabrics[leg.fabric]
            times, ok = _run_leg(job, leg, fabric, memory, barrier)
            record["times"][leg.name] = times
            record["ok"] = record["ok"] and ok
        if job.rank == 0:
            record["copies"] = {name: memory.copy_seconds(size, job.repeats)
                                for name, size in job.sizes.items()}
            record["device_name"] = memory.device_name()
        results.put(record)
    finally:
        for fabric in fabrics.values():
            fabric.close()
        memory.close()


def _run_leg(job: RankJob, leg: LegSpec, fabric: Fabric, memory: _Memory, barrier: Any
             ) -> tuple[list[float], bool]:
    size = job.sizes[leg.buffer]
    host = leg.fabric == "tcp"  # the host p2p the staged leg is compared with
    buf = memory.source(size, host) if job.rank == 0 else memory.zeros(size, host)
    name = f"{leg.name}-{leg.buffer}"
    fabric.register(name, buf)
    times: list[float] = []
    ok = True
    for attempt in range(job.repeats + 1):  # attempt 0 warms up: connections, IPC handles, slots
        options = TransferOptions(chunk_bytes=job.chunk, tag=attempt)
        barrier.wait()
        start = time.monotonic()
        deadline = Deadline.after(job.timeout_s)
        if job.rank == 0:
            send_regions(fabric, 1, name, leg.send, Stream.KV, deadline, options=options)
        else:
            recv_regions(fabric, 0, name, leg.recv, Stream.KV, deadline, options=options)
        memory.synchronize()
        if attempt:
            times.append(time.monotonic() - start)
        elif job.rank == 1:
            ok = memory.landed(buf, leg.send, leg.recv)
            memory.clear(buf)
    fabric.unregister(name)
    return times, ok


def _fabric(job: RankJob, kind: str, memory: _Memory) -> Fabric:
    table = RankTable.local(job.ports[kind])
    if kind == "ipc":
        from transfer.ipc.fabric import CudaIpcFabric

        return CudaIpcFabric(table, job.rank, backend=memory.ipc_backend())
    from transfer.tcp.fabric import TcpFabric

    inner = TcpFabric(table, job.rank)
    if kind == "tcp":
        return inner
    from transfer.staged import StagedFabric

    return StagedFabric(inner)


class _Memory:
    """Buffers on the benchmark's device, its copies and its checks (torch on CUDA, numpy on CPU)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._ipc: Any = None
        if device == "cuda":
            import torch

            torch.cuda.set_device(0)

    def ipc_backend(self) -> Any:
        """The cuda-ipc fabric's backend: torch's on CUDA, the shared-memory double on CPU."""
        if self.device == "cuda":
            return None  # CudaIpcFabric's default, TorchIpcBackend
        from transfer.ipc.shm import SharedMemoryBackend

        self._ipc = SharedMemoryBackend()
        return self._ipc

    def zeros(self, size: int, host: bool = False) -> Any:
        if self.device == "cuda" and not host:
            import torch

            return torch.zeros(size, dtype=torch.uint8, device="cuda")
        import numpy as np

        if self._ipc is not None and not host:
            return self._ipc.allocate(size)  # shared memory, so the peer can open it
        return np.zeros(size, np.uint8)

    def source(self, size: int, host: bool = False) -> Any:
        buf = self.zeros(size, host)
        import numpy as np

        if isinstance(buf, np.ndarray):
            buf[:] = np.resize(np.arange(PATTERN, dtype=np.uint8), size)
        else:
            import torch

            # the period repeated, not arange(size) % 251: that would take 16 bytes per byte at peak
            period = torch.arange(PATTERN, dtype=torch.uint8, device="cuda")
            buf.copy_(period.repeat(size // PATTERN + 1)[:size])
            torch.cuda.synchronize()
        return buf

    def clear(self, buf: Any) -> None:
        import numpy as np

        if isinstance(buf, np.ndarray):
            buf[:] = 0
        else:
            buf.zero_()

    def synchronize(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def landed(self, buf: Any, send: Segments, recv: Segments) -> bool:
        """Whether `buf` holds the source's `send` bytes at `recv` (same lengths, in order)."""
        import numpy as np

        got = buf if isinstance(buf, np.ndarray) else buf.cpu().numpy()
        period = np.arange(PATTERN, dtype=np.uint8)
        for (src, n), (dst, m) in zip(send, recv, strict=True):
            want = np.resize(np.roll(period, -(src % PATTERN)), n)  # bytes src .. src+n of the source
            if n != m or not np.array_equal(got[dst : dst + m], want):
                return False
        return True

    def copy_seconds(self, size: int, repeats: int) -> float:
        """Median seconds of one device-to-device copy of `size` bytes (after a warm-up copy)."""
        import numpy as np

        src, dst = self.source(size), self.zeros(size)
        copy: Callable[[], object] = (partial(np.copyto, dst, src) if isinstance(dst, np.ndarray)
                                      else partial(dst.copy_, src))
        times = []
        for attempt in range(repeats + 1):
            self.synchronize()
            start = time.monotonic()
            copy()
            self.synchronize()
            if attempt:
                times.append(time.monotonic() - start)
        return statistics.median(times)

    def device_name(self) -> str:
        if self.device == "cuda":
            import torch

            return str(torch.cuda.get_device_name(0))
        return "cpu"

    def close(self) -> None:
        if self._ipc is not None:
            self._ipc.close()
