"""TCP-fabric behaviour beyond the conformance suite: late peers, prompt close, emulated links, small
messages read ahead of their receive and written by the posting thread, receives that cannot be
withdrawn."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from tests.helpers.eventually import eventually
from tests.helpers.transfer_fabrics import free_ports, run_all
from transfer.collectives import TransferOptions, recv_regions, send_regions
from transfer.core import Deadline, Handle, Rank
from transfer.errors import FabricClosed, PeerGone, PeerTimeout
from transfer.ranktable import RankTable
from transfer.tcp.fabric import TcpFabric
from transfer.tcp.inbound import InboundChannel, RecvOp
from transfer.tcp.wire import HEADER, MESSAGE_MAGIC


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


def test_a_peer_that_refuses_connections_past_the_grace_is_gone_before_the_deadline() -> None:
    table = RankTable.local(free_ports(2))
    fabric = TcpFabric(table, 0, refused_grace_s=0.3)
    try:
        fabric.register("x", bytearray(10))
        handle = fabric.send(1, "x", [(0, 10)], 1, Deadline.after(60))  # rank 1 never starts
        with pytest.raises(PeerGone, match=r"refused connections for 0\.3 s"):
            handle.wait(Deadline.after(60))
    finally:
        fabric.close()


def test_a_peer_that_left_and_refuses_connections_is_gone_at_once() -> None:
    # rank 1 connected to rank 0 (stream 1) and then died; rank 0 sends to it on another stream,
    # never connected before: the refusal fails it at once, not after REFUSED_GRACE_S (15 s)
    table = RankTable.local(free_ports(2))
    fabric, peer = TcpFabric(table, 0), TcpFabric(table, 1)
    try:
        fabric.register("x", bytearray(10))
        peer.register("x", bytearray(10))
        got = fabric.recv(1, "x", [(0, 10)], 1, Deadline.after(10))
        peer.send(0, "x", [(0, 10)], 1, Deadline.after(10)).wait(Deadline.after(10))
        got.wait(Deadline.after(10))
        peer.close()  # its listener and connections go away
        eventually(lambda: fabric._liveness.gone(1), message="rank 0's reader saw the connection close")
        start = time.monotonic()
        with pytest.raises(PeerGone, match="closed a connection with us and is not listening"):
            fabric.send(1, "x", [(0, 10)], 2, Deadline.after(60)).wait(Deadline.after(60))
        assert time.monotonic() - start < 2.0
    finally:
        fabric.close()
        peer.close()


def test_close_while_connecting_is_prompt() -> None:
    table = RankTable.local(free_ports(2))
    fabric = TcpFabric(table, 0)
    fabric.register("x", bytearray(10))
    idle = threading.active_count()
    handle = fabric.send(1, "x", [(0, 10)], 1, Deadline.after(30))  # rank 1 never starts
    before = eventually(lambda: threading.active_count() > idle and threading.active_count(),
                        message="the connecting thread running")
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


def _pair() -> tuple[TcpFabric, TcpFabric]:
    table = RankTable.local(free_ports(2))
    return TcpFabric(table, 0), TcpFabric(table, 1)


def _read_ahead(fabric: TcpFabric, peer: int, stream: int) -> int:
    """Small messages from (peer, stream) that `fabric`'s reader holds for receives not posted yet."""
    channel = fabric._inbound.get((Rank(peer), stream))
    return 0 if channel is None else len(channel._early)


def test_small_messages_that_arrived_first_complete_as_their_receive_is_posted() -> None:
    sender, receiver = _pair()
    try:
        big = bytes(range(256)) * 4096  # 1 MiB: read by the reader thread into its receive
        data = bytearray(b"one" + b"two" + big + b"three")
        sender.register("x", data)
        out = bytearray(len(data))
        receiver.register("x", out)
        segments = [(0, 3), (3, 3), (6, len(big)), (6 + len(big), 5)]
        sends = [sender.send(1, "x", [segment], 1, Deadline.after(10)) for segment in segments]
        eventually(lambda: _read_ahead(receiver, 0, 1) == 2, message="both small ones read ahead")
        first = receiver.recv(0, "x", [segments[0]], 1, Deadline.after(10))
        second = receiver.recv(0, "x", [segments[1]], 1, Deadline.after(10))
        assert first.done() and second.done()  # completed by the posting thread: nothing to wait for
        rest = [receiver.recv(0, "x", [segment], 1, Deadline.after(10)) for segment in segments[2:]]
        for handle in [*rest, *sends]:
            handle.wait(Deadline.after(10))
        assert out == data
    finally:
        sender.close()
        receiver.close()


def test_an_abort_drops_the_small_messages_read_ahead() -> None:
    sender, receiver = _pair()
    try:
        sender.register("x", bytearray(b"stale"))
        out = bytearray(5)
        receiver.register("x", out)
        sender.send(1, "x", [(0, 5)], 1, Deadline.after(10)).wait(Deadline.after(10))
        eventually(lambda: _read_ahead(receiver, 0, 1) == 1, message="the message read ahead")
        receiver.abort(0, 1, "test")
        late = receiver.recv(0, "x", [(0, 5)], 1, Deadline.after(0.3))
        with pytest.raises(PeerTimeout):
            late.wait(Deadline.after(0.3))  # not the stale message
        assert out == bytearray(5)
    finally:
        sender.close()
        receiver.close()


def test_small_messages_between_big_ones_keep_their_order_when_the_socket_is_full() -> None:
    sender, receiver = _pair()
    try:
        rng = np.random.default_rng(0)
        lengths = [256 << 10 if i % 3 == 0 else int(rng.integers(1, 4096)) for i in range(60)]
        offsets = np.cumsum([0, *lengths])[:-1].tolist()
        data = bytearray(rng.integers(0, 256, sum(lengths), dtype=np.uint8).tobytes())
        sender.register("x", data)
        out = bytearray(len(data))
        receiver.register("x", out)
        segments = list(zip(offsets, lengths, strict=True))
        sends = [sender.send(1, "x", [segment], 1, Deadline.after(20)) for segment in segments]
        time.sleep(0.3)  # the receiver reads nothing yet: the socket buffers fill up
        recvs = [receiver.recv(0, "x", [segment], 1, Deadline.after(20)) for segment in segments]
        for handle in [*recvs, *sends]:
            handle.wait(Deadline.after(20))
        assert out == data
    finally:
        sender.close()
        receiver.close()



def test_a_receive_being_filled_is_not_withdrawn_and_a_message_read_ahead_is_kept() -> None:
    mine, peer = socket.socketpair()
    channel = InboundChannel(1, 0, 1)
    try:
        channel.attach(mine)
        payload = bytes(range(256)) * 512  # 128 KiB: read by the reader thread into its receive
        out = bytearray(len(payload))
        filling = Handle(len(out), "filling")
        channel.post(RecvOp(filling, [memoryview(out)], len(out)))
        peer.sendall(HEADER.pack(MESSAGE_MAGIC, len(payload)) + payload[:1000])  # header and a part
        eventually(lambda: channel._filling is not None, message="the reader filling the receive")
        assert not channel.withdraw(filling, PeerTimeout("given up"))
        peer.sendall(payload[1000:])
        filling.wait(Deadline.after(10))
        assert out == payload

        peer.sendall(HEADER.pack(MESSAGE_MAGIC, 5) + b"early")  # read ahead: no receive waits
        eventually(lambda: len(channel._early) == 1, message="the message read ahead")
        small = bytearray(5)
        got = Handle(5, "early")
        channel.post(RecvOp(got, [memoryview(small)], 5))
        assert got.done() and small == b"early"
        assert not channel.withdraw(got, PeerTimeout("given up"))  # done already
    finally:
        channel.close()
        peer.close()


def test_refresh_replaces_a_connection_the_peer_dropped_and_fails_fast_when_it_is_gone() -> None:
    table = RankTable.local(free_ports(2))
    sender, receiver = TcpFabric(table, 0), TcpFabric(table, 1)
    data, out = bytearray(b"first"), bytearray(5)
    try:
        sender.register("x", data)
        receiver.register("x", out)
        got = receiver.recv(0, "x", [(0, 5)], 1, Deadline.after(10))
        sender.send(1, "x", [(0, 5)], 1, Deadline.after(10)).wait(Deadline.after(10))
        got.wait(Deadline.after(10))
        sender.refresh(1, 1)  # alive: kept (nothing to see)
        receiver.close()  # the peer restarts: the old connection is reset
        receiver = TcpFabric(table, 1)
        out[:] = bytes(5)
        receiver.register("x", out)
        time.sleep(0.1)  # the old connection's reset reaches the sender's socket (only the kernel sees it)
        sender.refresh(1, 1)
        data[:] = b"again"
        got = receiver.recv(0, "x", [(0, 5)], 1, Deadline.after(10))
        sender.send(1, "x", [(0, 5)], 1, Deadline.after(10)).wait(Deadline.after(10))
        got.wait(Deadline.after(10))
        assert out == b"again"  # not lost in the dead connection

        receiver.close()  # gone for good: the next send fails at once, not at its deadline
        time.sleep(0.1)  # (as above: the close reaches the sender's socket)
        sender.refresh(1, 1)
        start = time.monotonic()
        with pytest.raises(PeerGone):
            sender.send(1, "x", [(0, 5)], 1, Deadline.after(30)).wait(Deadline.after(30))
        assert time.monotonic() - start < 5
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("with_resets", [True, False])
def test_a_retry_right_after_the_peer_reset_the_edge_connects_afresh_with_its_generation(
    monkeypatch: pytest.MonkeyPatch, with_resets: bool
) -> None:
    # The receiver aborts the edge while its reset is still on the way (on a real network it takes a
    # round trip; here its socket shutdown is held back 1.5 s). A retry posted at once: with the edge
    # generations (`Resets`) the sender's refresh sees the receiver's count moved and connects afresh;
    # without them (the negative control) it writes into the dead connection and the message is lost.
    import transfer.tcp.inbound as inbound
    from transfer.rendezvous import DictRendezvous

    real_unblock = inbound.unblock
    monkeypatch.setattr(inbound, "unblock", lambda sock: threading.Timer(1.5, real_unblock, (sock,)).start())
    table = RankTable.local(free_ports(2))
    board = DictRendezvous() if with_resets else None
    sender, receiver = TcpFabric(table, 0, resets=board), TcpFabric(table, 1, resets=board)
    try:
        sender.register("x", bytearray(b"first"))
        out = bytearray(5)
        receiver.register("x", out)
        got = receiver.recv(0, "x", [(0, 5)], 1, Deadline.after(5))
        sender.send(1, "x", [(0, 5)], 1, Deadline.after(5)).wait(Deadline.after(5))
        got.wait(Deadline.after(5))
        receiver.abort(0, 1, "the exchange failed on this side")  # its shutdown is on the way
        sender.register("y", bytearray(b"again"))
        got = receiver.recv(0, "x", [(0, 5)], 1, Deadline.after(1.0))
        sender.refresh(1, 1)
        sender.send(1, "y", [(0, 5)], 1, Deadline.after(1.0))
        if with_resets:
            got.wait(Deadline.after(3))
            assert out == b"again"
        else:
            with pytest.raises(PeerTimeout):
                got.wait(Deadline.after(3))
    finally:
        sender.close()
        receiver.close()
