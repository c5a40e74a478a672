"""Frames between the gRPC front process and the replica: msgspec messages over a socket pair.

A frame is a 4-byte little-endian length and one msgpack message of the schema (`messages.py`),
wrapped in an envelope below. Both ends are our own processes, started together.

Hot socket (ENGINE-lane calls; the replica's end is read by the engine thread, `core_server.py`):
```
 front → replica   Hello(port)                         once, after the front bound its port
                   Request(call_id, deadline, call)    deadline: time.monotonic() value or None
 replica → front   Reply(call_id, value, failure)      value: the call's reply; failure: its error
```
Service socket (SERVICE-lane calls; read by the replica's service threads):
```
 front → replica   Request(call_id, deadline, call)
                   Cancel(call_id)                     the caller cancelled or its deadline passed
 replica → front   Reply(call_id, value, failure)      exactly once per call (also after Cancel)
                   Serving(serving)                    the grpc.health.v1 status to publish
```
The front decodes a Reply's value only as far as `msgspec.Raw` and the waiting handler thread
decodes it into the call's reply type (`Call.reply`), so the reader thread stays short.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Any

import msgspec

from replica.server.messages import AnyCall

_LENGTH = struct.Struct("<I")


class Failure(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A call's error: the `Status` name, the message and the `x-pdcluster-cause` value (if any)."""

    status: str
    message: str
    cause: str | None = None


class Hello(msgspec.Struct, frozen=True, array_like=True, tag=True, gc=False):
    """The front's first frame: the port it serves on (0: it could not bind)."""

    port: int


class Request(msgspec.Struct, frozen=True, array_like=True, tag=True, gc=False):
    """One call to run."""

    call_id: int
    deadline: float | None
    call: AnyCall


class Cancel(msgspec.Struct, frozen=True, array_like=True, tag=True, gc=False):
    """The caller of `call_id` is gone."""

    call_id: int


class Reply(msgspec.Struct, frozen=True, array_like=True, tag=True, gc=False):
    """One call's outcome: `value` (the call's reply type) or `failure`."""

    call_id: int
    value: Any = None
    failure: Failure | None = None


class RawReply(msgspec.Struct, frozen=True, array_like=True, tag="Reply", gc=False):
    """`Reply` as the front reads it: the value left encoded for the waiting thread."""

    call_id: int
    value: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    failure: Failure | None = None


class Serving(msgspec.Struct, frozen=True, array_like=True, tag=True, gc=False):
    """The replica's health to publish on grpc.health.v1 (serving or not)."""

    serving: bool


ToReplica = Hello | Request | Cancel
ToFront = RawReply | Serving


class FrameSocket:
    """Length-prefixed messages over a stream socket; `send` is thread-safe, `recv` has one reader."""

    def __init__(self, sock: socket.socket, incoming: Any) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def send(self, message: Any) -> None:
        """Send one message (raises OSError once the peer is gone)."""
        with self._send_lock:
            frame = bytearray(_LENGTH.size)
            self._encoder.encode_into(message, frame, _LENGTH.size)
            _LENGTH.pack_into(frame, 0, len(frame) - _LENGTH.size)
            self.sock.sendall(frame)

    def recv(self) -> Any | None:
        """The next message, or None once the peer closed its end."""
        header = self._exactly(_LENGTH.size)
        if header is None:
            return None
        body = self._exactly(_LENGTH.unpack(header)[0])
        return None if body is None else self._decoder.decode(body)

    def _exactly(self, size: int) -> bytearray | None:
        buffer = bytearray(size)
        return buffer if self._into(memoryview(buffer)) else None

    def _into(self, view: memoryview) -> bool:
        """Fill `view` from the socket (False at EOF or error)."""
        got, size = 0, len(view)
        while got < size:
            try:
                count = self.sock.recv_into(view[got:])
            except OSError:
                return False
            if count == 0:
                return False
            got += count
        return True

    def shutdown(self) -> None:
        """End both directions (the peer and our own reader see EOF); the descriptor stays open."""
        with contextlib.suppress(OSError):  # already closed by the peer
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close both directions (the peer's `recv` returns None)."""
        self.shutdown()
        self.sock.close()


class BufferedFrameSocket(FrameSocket):
    """A `FrameSocket` whose `recv` reads all that is there (up to `capacity` bytes) in one call and
    slices frames out of it: one syscall and one allocation per frame instead of two and two.

    Only for a reader that blocks in `recv` (the front's reply readers): frames already read sit in
    this buffer, where a `select` on the socket cannot see them (so not for the engine thread's
    reader, which reads only when select says readable). Each frame is copied out before it is
    decoded: a `msgspec.Raw` keeps pointing into the bytes it was decoded from.
    """

    def __init__(self, sock: socket.socket, incoming: Any, capacity: int = 256 * 1024) -> None:
        super().__init__(sock, incoming)
        self._buffer = bytearray(capacity)
        self._view = memoryview(self._buffer)
        self._start = 0  # unread bytes are _buffer[_start:_end]
        self._end = 0

    def recv(self) -> Any | None:
        """The next message, or None once the peer closed its end."""
        while True:
            start, end = self._start, self._end
            if end - start >= _LENGTH.size:
                size = _LENGTH.unpack_from(self._buffer, start)[0]
                begin = start + _LENGTH.size
                if end - begin >= size:
                    self._start = begin + size
                    if self._start == end:
                        self._start = self._end = 0
                    return self._decoder.decode(bytes(self._view[begin : begin + size]))
                if _LENGTH.size + size > len(self._buffer):
                    return self._large(begin, size)
            if start:  # move the partial frame to the front, making room after it
                self._buffer[: end - start] = bytes(self._view[start:end])  # they may overlap
                self._start, self._end = 0, end - start
            if not self._fill():
                return None

    def _fill(self) -> bool:
        """Read what the socket has into the free end of the buffer (False at EOF or error)."""
        try:
            count = self.sock.recv_into(self._view[self._end :])
        except OSError:
            return False
        self._end += count
        return count > 0

    def _large(self, begin: int, size: int) -> Any | None:
        """A frame that does not fit the buffer: the part already read, then the rest directly."""
        have = self._end - begin
        frame = bytearray(size)
        frame[:have] = self._view[begin : self._end]
        self._start = self._end = 0
        return self._decoder.decode(frame) if self._into(memoryview(frame)[have:]) else None
