"""The cuda-ipc fabric's hardware-free logic: its control messages, the pairing of a gather list
with a scatter list, and the control fabric's stream numbers.

Control travels on the control fabric (tcp) in three streams per data stream `s`:
```
 host(s)    host-memory messages of stream s, as they are (both directions)
 ticket(s)  receiver → sender: TICKET (seq, scatter list, buffer key + IPC handle) or CANCEL(seq)
 answer(s)  sender → receiver: ANSWER(seq, status) once the copy into the scatter list has finished
```
A ticket is two control messages: a fixed-size header, then (when it has one) a body whose size the
header gives, so that the sender can post a receive of the right size for each.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.core import Segment, Segments
from transfer.errors import TransferError

PROTOCOL_VERSION = 1
TICKET_HEADER = struct.Struct("!4sBBQQIHI")  # magic, version, kind, seq, nbytes, segments, key, handle
ANSWER = struct.Struct("!4sBBQ")  # magic, version, status, seq
_SEGMENT = struct.Struct("!QQ")
_MAGIC = b"IPCT"
_ANSWER_MAGIC = b"IPCA"


class TicketKind(enum.IntEnum):
    """What a ticket header announces."""

    TICKET = 1  # a posted receive: write into my scatter list
    CANCEL = 2  # take back the ticket `seq` if no send has taken it yet


class AnswerStatus(enum.IntEnum):
    """The sender's answer to one ticket (answers come in ticket order)."""

    DONE = 1  # the bytes are in the receiver's memory (the copy's event has completed)
    CANCELED = 2  # the ticket was taken back before any send took it
    SIZE_MISMATCH = 3  # the send and the receive have different sizes: both fail, the pair stays up
    FAILED = 4  # the sender could not open the receiver's memory or copy into it


@dataclass(frozen=True)
class Ticket:
    """A receiver's posted receive, as announced to the sender."""

    kind: TicketKind
    seq: int
    segments: tuple[Segment, ...] = ()
    key: str = ""  # which registration of the receiver's buffer (name and generation)
    handle: bytes = b""  # its IPC handle (the sender opens it once per key and caches it)

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.segments)

    def header(self) -> bytes:
        key = self.key.encode()
        return TICKET_HEADER.pack(_MAGIC, PROTOCOL_VERSION, self.kind, self.seq, self.nbytes,
                                  len(self.segments), len(key), len(self.handle))

    def body(self) -> bytes:
        """The second message (empty when the ticket has no segments, key or handle: then none is sent)."""
        return (self.key.encode() + self.handle
                + b"".join(_SEGMENT.pack(offset, length) for offset, length in self.segments))


@dataclass(frozen=True)
class TicketHeader:
    """A decoded ticket header: enough to receive the body."""

    kind: TicketKind
    seq: int
    nbytes: int
    count: int
    key_len: int
    handle_len: int

    @property
    def body_len(self) -> int:
        return self.key_len + self.handle_len + self.count * _SEGMENT.size

    @classmethod
    def decode(cls, data: bytes | bytearray) -> TicketHeader:
        magic, version, kind, seq, nbytes, count, key_len, handle_len = TICKET_HEADER.unpack(data)
        if magic != _MAGIC or version != PROTOCOL_VERSION:
            raise TransferError(f"not a cuda-ipc ticket of protocol {PROTOCOL_VERSION}: {bytes(data[:6])!r}")
        return cls(TicketKind(kind), seq, nbytes, count, key_len, handle_len)

    def ticket(self, body: bytes | bytearray) -> Ticket:
        """The whole ticket, from this header and its body."""
        if len(body) != self.body_len:
            raise TransferError(f"ticket {self.seq}: body of {len(body)} bytes, expected {self.body_len}")
        key = bytes(body[: self.key_len]).decode()
        handle = bytes(body[self.key_len : self.key_len + self.handle_len])
        start = self.key_len + self.handle_len
        segments = tuple(_SEGMENT.unpack_from(body, start + i * _SEGMENT.size) for i in range(self.count))
        ticket = Ticket(self.kind, self.seq, segments, key, handle)
        if ticket.nbytes != self.nbytes:
            raise TransferError(f"ticket {self.seq}: segments total {ticket.nbytes}, header {self.nbytes}")
        return ticket


def encode_answer(seq: int, status: AnswerStatus) -> bytes:
    """One answer message."""
    return ANSWER.pack(_ANSWER_MAGIC, PROTOCOL_VERSION, status, seq)


def decode_answer(data: bytes | bytearray) -> tuple[int, AnswerStatus]:
    """(seq, status) of an answer message."""
    magic, version, status, seq = ANSWER.unpack(data)
    if magic != _ANSWER_MAGIC or version != PROTOCOL_VERSION:
        raise TransferError(f"not a cuda-ipc answer of protocol {PROTOCOL_VERSION}: {bytes(data[:6])!r}")
    return seq, AnswerStatus(status)


@dataclass(frozen=True)
class Piece:
    """One device copy: `nbytes` from the sender's offset `src` to the receiver's offset `dst`."""

    src: int
    dst: int
    nbytes: int


def pair_pieces(gather: Segments, scatter: Segments) -> list[Piece]:
    """The copies moving `gather` (in order) into `scatter` (in order), cut where either list's
    segment boundaries fall and merged where both sides are contiguous (one copy, not two)."""
    if sum(n for _, n in gather) != sum(n for _, n in scatter):
        raise ValueError("the gather and the scatter lists have different totals")
    pieces: list[Piece] = []
    src = [(o, n) for o, n in gather if n]
    dst = [(o, n) for o, n in scatter if n]
    si = di = s_used = d_used = 0
    while si < len(src) and di < len(dst):
        (s_off, s_len), (d_off, d_len) = src[si], dst[di]
        n = min(s_len - s_used, d_len - d_used)
        piece = Piece(s_off + s_used, d_off + d_used, n)
        last = pieces[-1] if pieces else None
        if last is not None and last.src + last.nbytes == piece.src and last.dst + last.nbytes == piece.dst:
            pieces[-1] = Piece(last.src, last.dst, last.nbytes + n)
        else:
            pieces.append(piece)
        s_used, d_used = s_used + n, d_used + n
        if s_used == s_len:
            si, s_used = si + 1, 0
        if d_used == d_len:
            di, d_used = di + 1, 0
    return pieces


@dataclass(frozen=True)
class ControlStreams:
    """The control fabric's streams that carry data stream `stream` (all distinct, all ≥ 0, for
    every int stream, control streams included: a zigzag of the stream, times three)."""

    host: int
    ticket: int
    answer: int

    @classmethod
    def of(cls, stream: int) -> ControlStreams:
        zigzag = 2 * stream if stream >= 0 else -2 * stream - 1
        return cls(3 * zigzag, 3 * zigzag + 1, 3 * zigzag + 2)

    def all(self) -> Sequence[int]:
        return (self.host, self.ticket, self.answer)
