"""TCP-fabric behaviour beyond the conformance suite: late peers, prompt close, emulated links."""

from __future__ import annotations

import threading
import time

import numpy as np

from tests.helpers.transfer_fabrics import free_ports, run_all
from transfer.collectives import TransferOptions, recv_regions, send_regions
from transfer.core import Deadline
from transfer.errors import FabricClosed
from transfer.ranktable import RankTable
from transfer.tcp.fabric import TcpFabric


def test_a_peer_that_starts_later_is_reached() -> None:
    table = RankTable.local(free_ports(2))
    sender = TcpFabric(table, 0)
    receiver: list[TcpFabric] = []
    try:
        sender.register("x", bytearray(b"hello"))
        handle = sender.send(1, "x", [(0, 5)], 1, Deadline.after(10))
        time.sleep(0.3)  # rank 1 is not listening yet: the sender keeps retrying
        receiver.append(TcpFabric(table, 1))
        out = bytearray(5)
        receiver[0].register("x", out)
        receiver[0].recv(0, "x", [(0, 5)], 1, Deadline.after(10)).wait(Deadline.after(10))
        handle.wait(Deadline.after(10))
        assert out == b"hello"
    finally:
        sender.close()
        for fabric in receiver:
            fabric.close()


def test_close_while_connecting_is_prompt() -> None:
    table = RankTable.local(free_ports(2))
    fabric = TcpFabric(table, 0)
    fabric.register("x", bytearray(10))
    handle = fabric.send(1, "x", [(0, 10)], 1, Deadline.after(30))  # rank 1 never starts
    time.sleep(0.2)
    before = threading.active_count()
    start = time.monotonic()
    fabric.close()
    assert time.monotonic() - start < 3
    assert isinstance(handle.error, FabricClosed)
    assert threading.active_count() < before


def test_emulated_inter_node_link_paces_the_transfer() -> None:
    ports = free_ports(2)
    table = RankTable.from_records([
        {"rank": r, "host": "127.0.0.1", "node": f"n{r}", "device": "cpu",
         "transfer_address": f"127.0.0.1:{p}", "link_gbps": 0.4}  # 50 MB/s NICs
        for r, p in enumerate(ports)
    ])
    fabrics = [TcpFabric(table, r) for r in range(2)]
    try:
        size = 4_000_000
        src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
        fabrics[0].register("x", src)
        fabrics[1].register("x", dst)
        options = TransferOptions(chunk_bytes=250_000)
        deadline = Deadline.after(30)
        start = time.monotonic()
        errors = run_all([
            lambda: send_regions(fabrics[0], 1, "x", [(0, size)], 2, deadline, options=options),
            lambda: recv_regions(fabrics[1], 0, "x", [(0, size)], 2, deadline, options=options),
        ])
        elapsed = time.monotonic() - start
        assert errors == [None, None] and np.array_equal(src, dst)
        assert elapsed >= 0.08 - 0.02  # 4 MB at 50 MB/s, less the pacer's lag allowance
    finally:
        for fabric in fabrics:
            fabric.close()
