"""The conformance suite on the real NCCL fabric (cupy): each rank's fabric runs on its own GPU
in this process. Skips without cupy or without two GPUs."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from tests.helpers.transfer_conformance import CASES, RECOVERY_CASES
from tests.helpers.transfer_fabrics import local_table, run_all
from transfer.fabric import Fabric
from transfer.rendezvous import DictRendezvous


def _gpu_count() -> int:
    try:
        import cupy
    except ImportError:
        return -1
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


GPUS = _gpu_count()
_WHY = "cupy is not installed (install the gpu extra)" if GPUS < 0 else f"needs 2 GPUs, found {GPUS}"
pytestmark = pytest.mark.skipif(GPUS < 2, reason=_WHY)

def _make(n: int) -> list[Fabric]:
    from transfer.nccl.fabric import NcclFabric

    if n > GPUS:
        pytest.skip(f"case needs {n} GPUs, found {GPUS}")
    table, rendezvous = local_table(n), DictRendezvous()
    fabrics: list[Any] = [None] * n

    def build(rank: int) -> None:
        fabrics[rank] = _HostMirroring(NcclFabric(table, rank, rendezvous, device=rank))

    errors = run_all([partial(build, r) for r in range(n)])
    assert not any(errors), errors
    return fabrics


class _HostMirroring:
    """Wraps a device fabric so the host-memory conformance cases run unchanged: registered host
    arrays get a device twin; receives copy back to the host when their handle completes."""

    def __init__(self, fabric: Any) -> None:
        import cupy

        self._cupy, self._fabric = cupy, fabric
        self._pairs: dict[str, tuple[Any, Any]] = {}
        self.rank = fabric.rank

    def register(self, name: str, obj: Any) -> int:
        import numpy as np

        host = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj.view(np.uint8)
        with self._cupy.cuda.Device(self.rank):
            device = self._cupy.asarray(host)
        self._pairs[name] = (host, device)
        return self._fabric.register(name, device)

    def recv(self, peer: int, name: str, segments: Any, stream: int, deadline: Any) -> Any:
        handle = self._fabric.recv(peer, name, segments, stream, deadline)
        host, device = self._pairs[name]

        def copy_back(_: Any) -> None:
            with self._cupy.cuda.Device(self.rank):
                for offset, length in segments:
                    host[offset : offset + length] = device[offset : offset + length].get()

        handle.add_done_callback(copy_back)
        return handle

    def send(self, peer: int, name: str, segments: Any, stream: int, deadline: Any) -> Any:
        host, device = self._pairs[name]
        with self._cupy.cuda.Device(self.rank):
            for offset, length in segments:
                device[offset : offset + length] = self._cupy.asarray(host[offset : offset + length])
        return self._fabric.send(peer, name, segments, stream, deadline)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._fabric, attribute)


@pytest.mark.parametrize("case", sorted(CASES))
def test_nccl_conformance_on_gpus(case: str) -> None:
    if case in RECOVERY_CASES:
        pytest.skip("NCCL edges are reusable only once both sides aborted them")
    CASES[case](_make)
