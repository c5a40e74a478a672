"""The fabric factory: picks the backend, imports device libraries only when chosen, refuses typos."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.transfer_fabrics import local_table
from transfer.errors import FabricUnavailable
from transfer.fabric import FabricKind, create_fabric
from transfer.fake import FakeFabric, FakeNetwork

ROOT = Path(__file__).resolve().parents[3]


def test_factory_builds_tcp_and_fake() -> None:
    table = local_table(2)
    with create_fabric("fake", table, 0, network=FakeNetwork()) as fake:
        assert isinstance(fake, FakeFabric)
    with create_fabric(FabricKind.TCP, table, 1) as tcp:
        assert tcp.rank == 1
    with pytest.raises(TypeError):
        create_fabric("tcp", table, 0, chunk_bytes=1)
    with pytest.raises(ValueError, match="not in the rank table"):
        create_fabric("fake", table, 7, network=FakeNetwork())


def test_importing_the_layer_loads_no_device_library_nor_torch() -> None:
    code = ("import sys, transfer.collectives, transfer.fabric, transfer.tcp.fabric, transfer.fake; "
            "print([m for m in ('cupy', 'pyverbs', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("kind", "module"), [("nccl", "cupy"), ("rdma", "pyverbs")])
def test_missing_device_library_fails_at_creation(kind: str, module: str) -> None:
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    from transfer.rendezvous import DictRendezvous

    with pytest.raises(FabricUnavailable, match=f"fabric {kind} cannot start: it needs .*{module}") as caught:
        create_fabric(kind, local_table(2), 0, rendezvous=DictRendezvous())
    assert "\n" not in str(caught.value)  # one line: what the replica prints when it refuses to start
