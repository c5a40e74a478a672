"""One (peer, stream) of the RDMA fabric: a reliable-connected queue pair and its protocol state.

Everything here runs on the fabric's progress thread (no locks): posting a send or a receive,
sending tickets, matching tickets to sends, and handling completions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from transfer.core import Deadline, Handle
from transfer.errors import TransferError
from transfer.rdma.logic import (
    SLOT_BYTES,
    LocalSegment,
    RemoteSegment,
    SendWindow,
    Ticket,
    VerbsBackend,
    WritePlan,
    plan_writes,
)

RECV_SLOTS = 32  # posted receives for incoming tickets and write-with-immediate completions
TICKET_SLOTS = 32  # our outgoing tickets in flight
MAX_WRITE_BYTES = 1 << 20


class Kind:
    """Work-request kinds, encoded in the wr_id."""

    RECV_SLOT = 1
    TICKET = 2
    LAST_WRITE = 3


def wr_id(channel: int, generation: int, kind: int, index: int) -> int:
    """Pack (channel, generation, kind, index) into a 64-bit work-request id."""
    return (channel << 40) | ((generation & 0xFF) << 32) | (kind << 28) | index


def unpack_wr_id(value: int) -> tuple[int, int, int, int]:
    """The inverse of `wr_id`."""
    return value >> 40, (value >> 32) & 0xFF, (value >> 28) & 0xF, value & 0x0FFFFFFF


@dataclass
class SendOp:
    handle: Handle
    sges: list[LocalSegment]
    deadline: Deadline
    owner: object


@dataclass
class RecvOp:
    handle: Handle
    segments: list[RemoteSegment]
    deadline: Deadline
    owner: object
    seq: int = -1


class Channel:
    """Protocol state of one queue pair."""

    def __init__(self, backend: VerbsBackend, index: int, qp: Any, control: bytearray, control_lkey: int,
                 control_addr: int, generation: int) -> None:
        self.backend, self.index, self.qp, self.generation = backend, index, qp, generation
        self.control, self.control_lkey, self.control_addr = control, control_lkey, control_addr
        self.window = SendWindow(capacity=256)
        self.sends: deque[SendOp] = deque()
        self.tickets: deque[Ticket] = deque()
        self.waiting_recvs: deque[RecvOp] = deque()  # not yet announced (no free ticket slot)
        self.recvs: deque[RecvOp] = deque()  # announced, in sequence order
        self.in_flight: dict[int, tuple[SendOp, int]] = {}
        self.free_tickets = list(range(TICKET_SLOTS))
        self.next_seq = 0
        self.next_send = 0
        for slot in range(RECV_SLOTS):
            self._post_recv_slot(slot)

    def _slot(self, index: int) -> LocalSegment:
        return LocalSegment(self.control_addr + index * SLOT_BYTES, SLOT_BYTES, self.control_lkey)

    def _post_recv_slot(self, slot: int) -> None:
        self.backend.post_recv(self.qp, wr_id(self.index, self.generation, Kind.RECV_SLOT, slot),
                               [self._slot(slot)])

    def post_send(self, op: SendOp) -> None:
        self.sends.append(op)
        self.pump()

    def post_recv(self, op: RecvOp) -> None:
        self.waiting_recvs.append(op)
        self.pump()

    def pump(self) -> None:
        """Announce waiting receives and start every send that has a ticket and window room."""
        while self.waiting_recvs and self.free_tickets:
            self._announce(self.waiting_recvs.popleft())
        while self.sends and self.tickets:
            writes = plan_writes(self.sends[0].sges, self.tickets[0].segments, self.backend.max_sge,
                                 MAX_WRITE_BYTES)
            if len(writes) + 1 > self.window.room():
                return
            self._start(self.sends.popleft(), self.tickets.popleft(), writes)

    def _announce(self, op: RecvOp) -> None:
        op.seq, self.next_seq = self.next_seq, self.next_seq + 1
        slot = self.free_tickets.pop()
        payload = Ticket(op.seq, tuple(op.segments)).encode()
        start = slot_offset(RECV_SLOTS + slot)
        self.control[start : start + len(payload)] = payload
        sge = LocalSegment(self.control_addr + start, len(payload), self.control_lkey)
        self.recvs.append(op)
        self.backend.post_send(self.qp, wr_id(self.index, self.generation, Kind.TICKET, slot), [sge])

    def _start(self, op: SendOp, ticket: Ticket, writes: list[WritePlan]) -> None:
        for write in writes:
            self.backend.post_write(self.qp, 0, write, imm=None, signaled=False)
        send_id, self.next_send = self.next_send, self.next_send + 1
        last = WritePlan((), 0, 0)  # zero-length write carrying the ticket's sequence number
        self.backend.post_write(self.qp, wr_id(self.index, self.generation, Kind.LAST_WRITE, send_id), last,
                                imm=ticket.seq & 0xFFFFFFFF, signaled=True)
        self.window.take(len(writes) + 1)
        self.in_flight[send_id] = (op, len(writes) + 1)

    def on_completion(self, kind: int, index: int, imm: int | None) -> None:
        """A successful completion of one of this channel's work requests."""
        if kind == Kind.RECV_SLOT:
            if imm is None:
                start = slot_offset(index)
                self.tickets.append(Ticket.decode(memoryview(self.control)[start : start + SLOT_BYTES]))
            else:
                self._landed(imm)
            self._post_recv_slot(index)
        elif kind == Kind.TICKET:
            self.free_tickets.append(index)
        elif kind == Kind.LAST_WRITE:
            op, count = self.in_flight.pop(index)
            self.window.release(count)
            op.handle._complete()
        self.pump()

    def _landed(self, imm: int) -> None:
        op = self.recvs.popleft()
        if op.seq & 0xFFFFFFFF != imm:
            raise TransferError(f"write-with-immediate {imm} arrived for receive {op.seq}")
        op.handle._complete()

    def pending(self) -> list[Handle]:
        """Every handle still pending on this channel."""
        ops: list[SendOp | RecvOp] = [*self.sends, *self.waiting_recvs, *self.recvs]
        return [op.handle for op in ops] + [op.handle for op, _ in self.in_flight.values()]

    def expired(self) -> bool:
        """Whether a pending operation's deadline has passed."""
        ops: list[SendOp | RecvOp] = [*self.sends, *self.waiting_recvs, *self.recvs]
        ops += [op for op, _ in self.in_flight.values()]
        return any(op.deadline.expired() for op in ops)


def slot_offset(slot: int) -> int:
    """Byte offset of control slot `slot` (receive slots first, then ticket slots)."""
    return slot * SLOT_BYTES
