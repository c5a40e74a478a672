"""The TCP handshake bytes, the stream numbering and the emulated-link pacer."""

from __future__ import annotations

import socket
import time

import pytest

from transfer.core import Deadline, Handle, Stream, control_stream
from transfer.errors import LayoutMismatch, PeerTimeout
from transfer.tcp.ratelimit import MAX_LAG_S, LinkPacer
from transfer.tcp.wire import PROTOCOL_VERSION, Hello, HelloStatus, read_hello, read_reply, write_reply


def test_handshake_round_trip_and_mismatch() -> None:
    a, b = socket.socketpair()
    with a, b:
        hello = Hello(PROTOCOL_VERSION, 7, Stream.KV, "block=16")
        a.sendall(hello.encode())
        assert read_hello(b) == hello
        write_reply(b, HelloStatus.OK, "block=16")
        read_reply(a, hello, 1)
        write_reply(b, HelloStatus.LAYOUT_MISMATCH, "block=64")
        with pytest.raises(LayoutMismatch, match="block=64"):
            read_reply(a, hello, 1)


def test_streams_and_control_streams() -> None:
    assert (Stream.ACTIVATION, Stream.KV, Stream.PARAMS) == (0, 1, 2)
    assert control_stream(0) == -1 and control_stream(2) == -3
    with pytest.raises(ValueError):
        control_stream(-1)


def test_pacer_holds_the_link_rate() -> None:
    pacer = LinkPacer(gbps=0.8)  # 100 MB/s
    start = time.monotonic()
    for _ in range(8):
        pacer.take(1_000_000, Deadline.after(5))
    # 8 MB at 100 MB/s is 80 ms, less the lag allowance the link may bank
    assert time.monotonic() - start >= 0.08 - MAX_LAG_S - 0.001
    with pytest.raises(PeerTimeout):
        pacer.take(100_000_000, Deadline.after(0.1))


def test_handle_wait_and_callbacks() -> None:
    seen: list[Handle] = []
    handle = Handle(3, "h")
    handle.add_done_callback(seen.append)
    handle._complete()
    handle._fail(PeerTimeout("ignored: already done"))
    handle.wait(Deadline.after(0))
    handle.add_done_callback(seen.append)
    assert seen == [handle, handle] and handle.error is None
    expired: list[bool] = []
    late = Handle(1, "late", on_timeout=lambda: expired.append(True))
    with pytest.raises(PeerTimeout, match="late"):
        late.wait(Deadline.after(0.01))
    assert expired == [True] and isinstance(late.error, PeerTimeout)
