"""Bytes on the wire of the TCP fabric: the handshake and the per-message header.

Connection (the sender connects to the receiver's transfer address)::

    sender → receiver   HELLO  magic "PDXH" | version u16 | rank u32 | stream i64 | layout_len u16 | layout
    receiver → sender   REPLY  magic "PDXR" | status u8 | layout_len u16 | receiver's layout

then messages, each `magic "PDXM" | nbytes u64` followed by `nbytes` of payload.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass

from transfer.errors import LayoutMismatch, PeerGone, TransferError

PROTOCOL_VERSION = 1
HELLO = struct.Struct("!4sHIqH")
REPLY = struct.Struct("!4sBH")
HEADER = struct.Struct("!4sQ")
HELLO_MAGIC, REPLY_MAGIC, MESSAGE_MAGIC = b"PDXH", b"PDXR", b"PDXM"
IOV_BATCH = 512  # iovecs per sendmsg/recvmsg_into call (IOV_MAX is 1024 on Linux)


class HelloStatus(enum.IntEnum):
    """The receiver's verdict on a HELLO."""

    OK = 0
    BAD_VERSION = 1
    LAYOUT_MISMATCH = 2
    UNKNOWN_RANK = 3


@dataclass(frozen=True)
class Hello:
    """What a sender announces."""

    version: int
    rank: int
    stream: int
    layout: str

    def encode(self) -> bytes:
        layout = self.layout.encode()
        return HELLO.pack(HELLO_MAGIC, self.version, self.rank, self.stream, len(layout)) + layout


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly `n` bytes (handshakes only; the data path reads into registered buffers)."""
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerGone("connection closed during the handshake")
        got += k
    return bytes(out)


def read_hello(sock: socket.socket) -> Hello:
    """Read and parse a HELLO."""
    magic, version, rank, stream, layout_len = HELLO.unpack(recv_exact(sock, HELLO.size))
    if magic != HELLO_MAGIC:
        raise TransferError(f"not a transfer connection (magic {magic!r})")
    return Hello(version, rank, stream, recv_exact(sock, layout_len).decode())


def write_reply(sock: socket.socket, status: HelloStatus, layout: str) -> None:
    """Answer a HELLO."""
    data = layout.encode()
    sock.sendall(REPLY.pack(REPLY_MAGIC, status, len(data)) + data)


def read_reply(sock: socket.socket, hello: Hello, peer: int) -> None:
    """Read the receiver's REPLY; raise unless it accepted `hello`."""
    magic, status, layout_len = REPLY.unpack(recv_exact(sock, REPLY.size))
    theirs = recv_exact(sock, layout_len).decode()
    if magic != REPLY_MAGIC:
        raise TransferError(f"rank {peer} answered with magic {magic!r}")
    if status == HelloStatus.LAYOUT_MISMATCH:
        raise LayoutMismatch(f"stream {hello.stream}: rank {peer} has layout {theirs!r}, we {hello.layout!r}")
    if status == HelloStatus.BAD_VERSION:
        raise LayoutMismatch(f"rank {peer} speaks another protocol version than {hello.version}")
    if status != HelloStatus.OK:
        raise TransferError(f"rank {peer} refused the connection: {HelloStatus(status).name}")
