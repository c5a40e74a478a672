"""`SplitFabric` (control on tcp, bulk on a device fabric) through the conformance suite, with numpy
buffers standing in for device memory and bulk fabrics that refuse host bytearrays as NCCL does
(a fake, and the NCCL fabric on its backend double): the suite's confirmations and headers in
bytearrays must travel on tcp for any case to pass."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from tests.helpers.transfer_conformance import CASES, RECOVERY_CASES
from tests.helpers.transfer_fabrics import FabricMaker, local_table, socket_fds, thread_names
from tests.helpers.transfer_nccl_double import DoubleBackend, DoubleWorld
from transfer.collectives import recv_regions, send_regions
from transfer.composite import SplitFabric, on_device
from transfer.core import Deadline, Stream
from transfer.errors import LayoutMismatch
from transfer.fabric import Fabric
from transfer.fake import FakeFabric, FakeNetwork
from transfer.nccl.fabric import NcclFabric
from transfer.rendezvous import DictRendezvous
from transfer.tcp.fabric import TcpFabric


def _device_only(obj: object) -> None:
    if not isinstance(obj, np.ndarray):
        raise ValueError(f"a {type(obj).__name__} is host memory: this device fabric cannot send it")


class DeviceOnlyFake(FakeFabric):
    """A fake device fabric: numpy arrays are its device memory; host bytearrays are refused."""

    def register(self, name: str, obj: object) -> int:
        _device_only(obj)
        return super().register(name, obj)


class DeviceOnlyBackend(DoubleBackend):
    """The NCCL backend double, refusing host bytearrays like cupy's `__cuda_array_interface__` check."""

    def pointer(self, obj: object) -> tuple[int, int]:
        _device_only(obj)
        return super().pointer(obj)


def _is_bulk(obj: object) -> bool:
    return isinstance(obj, np.ndarray)


def make_split_fake(n: int) -> list[Fabric]:
    table, network = local_table(n), FakeNetwork()
    return [SplitFabric(TcpFabric(table, r), DeviceOnlyFake(table, r, network=network), "fake", _is_bulk)
            for r in range(n)]


def make_split_nccl(n: int) -> list[Fabric]:
    table, rendezvous, world = local_table(n), DictRendezvous(), DoubleWorld()
    return [SplitFabric(TcpFabric(table, r),
                        NcclFabric(table, r, rendezvous, backend=DeviceOnlyBackend(world), warmup_streams=()),
                        "nccl", _is_bulk) for r in range(n)]


MAKERS: dict[str, FabricMaker] = {"tcp+fake": make_split_fake, "tcp+nccl-double": make_split_nccl}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_split_fabric_conformance(kind: str, case: str) -> None:
    if kind == "tcp+nccl-double" and case in {*RECOVERY_CASES, "withdraw"}:
        pytest.skip("NCCL cannot cancel an operation (see the NCCL double's suite): a device buffer's "
                    "receive is not taken back (host ones are, on tcp)")
    threads_before, sockets_before = thread_names(), socket_fds()
    CASES[case](MAKERS[kind])
    assert not thread_names() - threads_before, "threads leaked"
    assert socket_fds() <= sockets_before, "sockets leaked"


def test_host_buffers_go_to_control_and_device_buffers_to_bulk() -> None:
    a, b = make_split_fake(2)
    try:
        assert isinstance(a, SplitFabric)
        a.register("header", bytearray(8))
        a.register("kv", np.zeros(8, np.uint8))
        assert a._route("header") is a.control and a._route("kv") is a.bulk
        a.register("header", np.zeros(8, np.uint8))  # re-registered in device memory: moves to bulk
        assert a._route("header") is a.bulk
        a.unregister("header")
        with pytest.raises(KeyError):
            a.send(1, "header", [(0, 8)], 1, Deadline.after(1))
    finally:
        a.close()
        b.close()


def test_a_migration_header_on_control_then_pages_on_bulk() -> None:
    """The migration's pattern: a bytearray header and its KV pages on the same stream, on two fabrics."""
    a, b = make_split_nccl(2)
    try:
        src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
        header_out, header_in = bytearray(b"header!!"), bytearray(8)
        for fabric, kv, header in ((a, src, header_out), (b, dst, header_in)):
            fabric.set_layout(Stream.KV, "kv:test")
            fabric.register("kv", kv)
            fabric.register("h", header)
        deadline = Deadline.after(20)
        sent = a.send(1, "h", [(0, 8)], Stream.KV, deadline)
        b.recv(0, "h", [(0, 8)], Stream.KV, deadline).wait(deadline)
        assert header_in == header_out
        # NCCL matches call by call: the pages keep their lengths (as a migration's do), not their offsets
        sender = threading.Thread(target=send_regions, args=(a, 1, "kv", [(0, 16), (32, 16)], Stream.KV,
                                                             deadline))
        sender.start()
        recv_regions(b, 0, "kv", [(16, 16), (48, 16)], Stream.KV, deadline)  # confirmations: bytearrays
        sender.join()
        sent.wait(deadline)
        assert dst[16:32].tolist() == src[:16].tolist() and dst[48:].tolist() == src[32:48].tolist()
    finally:
        a.close()
        b.close()


def test_a_peer_whose_kv_goes_another_way_fails_the_handshake() -> None:
    """A split replica and a plain tcp one (KV in host memory): LayoutMismatch, not a silent wait."""
    table, network = local_table(2), FakeNetwork()
    split = SplitFabric(TcpFabric(table, 0), DeviceOnlyFake(table, 0, network=network), "nccl", _is_bulk)
    plain = TcpFabric(table, 1)
    try:
        for fabric in (split, plain):
            fabric.set_layout(Stream.KV, "kv:test")
        split.register("h", bytearray(8))  # a migration header: on tcp, whose handshake carries the route
        deadline = Deadline.after(10)
        with pytest.raises(LayoutMismatch, match="bulk=nccl"):
            split.send(1, "h", [(0, 8)], Stream.KV, deadline).wait(deadline)
    finally:
        split.close()
        plain.close()


def test_device_memory_is_what_the_replica_routes_to_bulk() -> None:
    torch: Any = pytest.importorskip("torch")
    assert not on_device(bytearray(4)) and not on_device(np.zeros(4)) and not on_device(torch.zeros(4))
    assert on_device(torch.zeros(4, device="meta"))
