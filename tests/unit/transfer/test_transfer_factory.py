"""The fabric factory: picks the backend, imports device libraries only when chosen, refuses typos."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.transfer_fabrics import local_table
from transfer.errors import FabricUnavailable
from transfer.fabric import FABRIC_CHOICES, FabricKind, choose_fabric, create_fabric, needs_store
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


def test_cuda_ipc_without_cuda_fails_at_creation_in_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(FabricUnavailable, match="fabric cuda-ipc cannot start: it needs torch with a CUDA "
                                                "device") as caught:
        create_fabric("cuda-ipc", local_table(2), 0)
    assert "\n" not in str(caught.value)


def test_cuda_ipc_with_a_backend_needs_no_cuda() -> None:
    from transfer.ipc.fabric import CudaIpcFabric
    from transfer.ipc.shm import SharedMemoryBackend

    with create_fabric(FabricKind.CUDA_IPC, local_table(2), 1, backend=SharedMemoryBackend()) as ipc:
        assert isinstance(ipc, CudaIpcFabric) and ipc.rank == 1


def test_the_rule_of_fabric_auto() -> None:
    every = lambda module: True  # noqa: E731
    none = lambda module: False  # noqa: E731
    # one node, CUDA buffers: cuda-ipc (whatever else is installed)
    assert choose_fabric(True, False, True, every) is FabricKind.CUDA_IPC
    assert choose_fabric(True, False, False, none) is FabricKind.CUDA_IPC
    # across nodes, CUDA buffers: rdma with a NIC and pyverbs, else nccl with cupy, else tcp (staged)
    assert choose_fabric(True, True, True, every) is FabricKind.RDMA
    assert choose_fabric(True, True, True, lambda m: m == "cupy") is FabricKind.NCCL
    assert choose_fabric(True, True, False, every) is FabricKind.NCCL
    assert choose_fabric(True, True, True, none) is FabricKind.TCP
    # host buffers: tcp, on one node or across
    assert choose_fabric(False, False, True, every) is FabricKind.TCP
    assert choose_fabric(False, True, True, every) is FabricKind.TCP


def test_which_choices_need_the_rendezvous_store() -> None:
    assert [c for c in FABRIC_CHOICES if needs_store(c)] == ["nccl", "rdma", "auto"]
