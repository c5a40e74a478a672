"""The conformance suite on the real RDMA fabric (pyverbs). Skips without pyverbs or a device."""

from __future__ import annotations

import pytest

from tests.helpers.transfer_conformance import CASES, RECOVERY_CASES
from tests.helpers.transfer_fabrics import local_table
from transfer.fabric import Fabric
from transfer.rendezvous import DictRendezvous


def _why_skip() -> str | None:
    try:
        import pyverbs.device as device
    except ImportError:
        return "pyverbs is not installed (Debian: apt-get install python3-pyverbs)"
    try:
        devices = device.get_device_list()
    except Exception as exc:  # rdma-core raises when no provider is usable
        return f"no RDMA device ({exc})"
    return None if devices else "no RDMA device found"


WHY = _why_skip()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def _make(n: int) -> list[Fabric]:
    from transfer.rdma.fabric import RdmaFabric

    table, rendezvous = local_table(n), DictRendezvous()
    return [RdmaFabric(table, r, rendezvous) for r in range(n)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_rdma_conformance_on_hardware(case: str) -> None:
    if case in RECOVERY_CASES:
        pytest.skip("a failed queue pair is reconnected only once both sides aborted it")
    CASES[case](_make)
