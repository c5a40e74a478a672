"""Frames between the gRPC front process and the replica: pickled tuples over a socket pair.

Both ends are our own processes (the replica spawns its front and hands it one end of each of
two `socket.socketpair()`s), so pickle is safe here. A frame is a 4-byte little-endian length and
a pickle. Step results travel as plain tuples (`encode_step` / `decode_step`): pickling the frozen
dataclasses themselves costs the engine thread ~3x more at batch 32.

Hot socket (read by the engine thread, hotpath.py):
```
 front → replica   ("port", port)                  once, after the front bound its port
                   (op, call_id, args, deadline)   op: decode | prefill | filter | clear;
                                                   deadline: time.monotonic() value or None;
                                                   decode args: [(batch_id, (token, ...)), ...]
 replica → front   (call_id, True, payload)        the result (encode_step / CachedBatchInfo / None)
                   (call_id, False, (status, msg)) a ReplicaError's Status value and message
```
Service channel (read by its own thread, service_channel.py): every other unary call of
TextGenerationService, as bytes.
```
 front → replica   ("rpc", call_id, (method, request, metadata), deadline)
                                                   method: "/generate.v2.TextGenerationService/X";
                                                   request: serialized; metadata: [(key, value)]
                   ("cancel", call_id, None, None) the caller cancelled or its deadline passed
 replica → front   (call_id, True, response)       the serialized response
                   (call_id, False, (code, details)) a grpc.StatusCode name (Status values are
                                                   the same names) and the details
```
Each call is answered exactly once (also after "cancel"; the front drops replies nobody waits for).
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import struct
import threading
from typing import Any

from replica.engine.types import (
    BatchId,
    CachedBatchInfo,
    FinishReason,
    GeneratedText,
    Generation,
    RequestId,
    StepResult,
    TokenList,
)

_LENGTH = struct.Struct("<I")


class FrameSocket:
    """Length-prefixed pickles over a stream socket; `send` is thread-safe, `recv` has one reader."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> None:
        """Send one message (raises OSError once the peer is gone)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.sock.sendall(_LENGTH.pack(len(data)) + data)

    def recv(self) -> Any | None:
        """The next message, or None once the peer closed its end."""
        header = self._exactly(_LENGTH.size)
        if header is None:
            return None
        body = self._exactly(_LENGTH.unpack(header)[0])
        return None if body is None else pickle.loads(body)

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
        with contextlib.suppress(OSError):  # already closed by the peer
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class BufferedFrameSocket(FrameSocket):
    """A `FrameSocket` whose `recv` reads all that is there (up to `capacity` bytes) in one call and
    slices frames out of it: one syscall and no allocation per frame instead of two and two.

    Only for a reader that blocks in `recv` (the front's reply readers): frames already read sit in
    this buffer, where a `select` on the socket cannot see them (so not for the engine thread's
    hot-path reader, which reads only when select says readable). A frame larger than `capacity`
    is read into a buffer of its own.
    """

    def __init__(self, sock: socket.socket, capacity: int = 256 * 1024) -> None:
        super().__init__(sock)
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
                    return pickle.loads(self._view[begin : begin + size])
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
        return pickle.loads(frame) if self._into(memoryview(frame)[have:]) else None


# ------------------------------------------------------------------------------------ step results
def _tokens(t: TokenList) -> tuple[Any, ...]:
    return (t.ids, t.logprobs, t.texts, t.is_special)


def _token_list(t: tuple[Any, ...]) -> TokenList:
    return TokenList(ids=t[0], logprobs=t[1], texts=t[2], is_special=t[3])


def _generation(g: Generation) -> tuple[Any, ...]:
    done = g.generated_text
    text = None if done is None else (done.text, done.generated_tokens, done.finish_reason.value, done.seed)
    prefill = None if g.prefill_tokens is None else _tokens(g.prefill_tokens)
    return (g.request_id, _tokens(g.tokens), prefill, text, tuple(_tokens(t) for t in g.top_tokens))


def _generation_back(t: tuple[Any, ...]) -> Generation:
    rid, tokens, prefill, text, tops = t
    done = None if text is None else GeneratedText(text[0], text[1], FinishReason(text[2]), text[3])
    return Generation(
        request_id=RequestId(rid),
        tokens=_token_list(tokens),
        prefill_tokens=None if prefill is None else _token_list(prefill),
        generated_text=done,
        top_tokens=tuple(_token_list(x) for x in tops),
    )


def encode_batch(info: CachedBatchInfo | None) -> tuple[Any, ...] | None:
    """A cached batch as a tuple (None stays None)."""
    return None if info is None else (info.id, info.request_ids, info.max_tokens)


def decode_batch(t: tuple[Any, ...] | None) -> CachedBatchInfo | None:
    """Inverse of `encode_batch`."""
    return None if t is None else CachedBatchInfo(BatchId(t[0]), tuple(t[1]), t[2])


def encode_step(result: StepResult) -> tuple[Any, ...]:
    """A StepResult as nested tuples of plain values."""
    return (
        tuple(_generation(g) for g in result.generations),
        encode_batch(result.batch),
        result.forward_ns,
        result.decode_ns,
        result.total_ns,
        result.concat_ns,
    )


def decode_step(t: tuple[Any, ...]) -> StepResult:
    """Inverse of `encode_step`."""
    generations, batch, forward_ns, decode_ns, total_ns, concat_ns = t
    return StepResult(
        tuple(_generation_back(g) for g in generations),
        decode_batch(batch),
        forward_ns,
        decode_ns,
        total_ns,
        concat_ns,
    )
