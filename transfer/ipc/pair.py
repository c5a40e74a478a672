"""The state of one (peer, stream) on the cuda-ipc fabric, both directions.

Touched only by the fabric's worker thread (no locks). Sending: sends waiting for a ticket,
tickets waiting for a send, and answers owed to the peer, in ticket order (a copy's answer goes out
once its event has completed). Receiving: receives whose ticket went out, waiting for their answer,
in sequence order.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from transfer.core import Deadline, Handle, Segment
from transfer.errors import TransferError
from transfer.ipc.backend import Completion, DeviceBuffer, RemoteBuffer
from transfer.ipc.logic import AnswerStatus, ControlStreams, Ticket


@dataclass(eq=False)
class SendOp:
    handle: Handle
    memory: DeviceBuffer
    segments: list[Segment]
    mark: object  # the producer's stream at `send`
    deadline: Deadline


@dataclass(eq=False)
class Withdrawal:
    """A caller waiting in `withdraw` for the sender's answer to its CANCEL."""

    error: TransferError
    taken: bool = False
    answered: threading.Event = field(default_factory=threading.Event)

    def answer(self, taken: bool) -> None:
        self.taken = taken
        self.answered.set()


@dataclass(eq=False)
class RecvOp:
    handle: Handle
    name: str
    segments: list[Segment]
    deadline: Deadline
    seq: int = -1
    withdrawal: Withdrawal | None = None


@dataclass(eq=False)
class Answer:
    """What the sender owes the receiver for one ticket."""

    seq: int
    status: AnswerStatus
    op: SendOp | None = None
    copy: Completion | None = None  # DONE: sent once this has completed
    remote: RemoteBuffer | None = None  # kept open while the copy runs

    def ready(self) -> bool:
        return self.copy is None or self.copy.done()


@dataclass(eq=False)
class Pair:
    peer: int
    stream: int
    streams: ControlStreams
    sends: deque[SendOp] = field(default_factory=deque)
    tickets: deque[Ticket] = field(default_factory=deque)
    answers: deque[Answer] = field(default_factory=deque)
    reading: bool = False  # a receive of the next ticket is posted on the control fabric
    recvs: deque[RecvOp] = field(default_factory=deque)
    next_seq: int = 0
    dead: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return self.peer, self.stream

    def handles(self) -> list[Handle]:
        """Every caller's handle still pending here."""
        ops = [op.handle for op in self.sends] + [op.handle for op in self.recvs]
        return ops + [a.op.handle for a in self.answers if a.op is not None]

    def expired(self) -> bool:
        deadlines = [op.deadline for op in self.sends] + [op.deadline for op in self.recvs]
        deadlines += [a.op.deadline for a in self.answers if a.op is not None]
        return any(d.expired() for d in deadlines)
