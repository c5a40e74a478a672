"""`CudaIpcFabric`: device memory of ranks on one host, moved by device copies into the peer's memory.

```
 rank B (receiver)                                      rank A (sender)
 recv(A, s, scatter) ─► TICKET(seq, scatter, key, IPC handle) ══ticket(s)══► matched to A's sends in order
                                                                             open B's buffer (once per key)
                                                       send(B, s, gather) ─► mark on A's current stream
                                                                             fabric stream: wait mark,
                                                                             copies gather → B's scatter,
                                                                             record event
 handle done ◄═════════════ ANSWER(seq, DONE) ═══answer(s)════════════════ once the event has completed
```
Control (tickets, answers, and whole messages of host-memory buffers) travels on a control fabric,
tcp by default, on three of its streams per data stream (`logic.ControlStreams`), never on gRPC.
Bulk bytes never touch the host. A receiver's handle completes only after the sender saw the copy's
event complete, so a consumer that waits on it finds the bytes in its memory.

One worker thread owns every (peer, stream) `Pair`: it posts tickets, reads the peer's tickets one
after the other (header, then body), matches them to sends, polls copy events, sends answers in
ticket order, and fails operations past their deadline. Callers' threads only queue work for it
(and mark the producer's stream, which must happen on the caller's thread).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from functools import partial

from transfer.buffers import check_segments
from transfer.core import Deadline, Handle, Segments, total_length
from transfer.errors import FabricClosed, PeerGone, PeerTimeout, TransferError
from transfer.fabric import Fabric
from transfer.ipc.backend import DeviceBuffer, IpcBackend, RemoteBuffer, TorchIpcBackend
from transfer.ipc.logic import (
    ANSWER,
    TICKET_HEADER,
    AnswerStatus,
    ControlStreams,
    Ticket,
    TicketHeader,
    TicketKind,
    decode_answer,
    encode_answer,
    pair_pieces,
)
from transfer.ipc.pair import Answer, Pair, RecvOp, SendOp, Withdrawal
from transfer.ranktable import RankTable

_POLL_S = 0.0002  # while copies are in flight
_IDLE_S = 0.05  # deadlines are checked at least this often
_FAR = 10.0**9  # control receives that wait for the peer's next message as long as the pair lives
WITHDRAW_WAIT_S = 2.0  # how long `withdraw` waits for the sender's answer to its CANCEL

Work = Callable[[], None]


class _Registration:
    def __init__(self, memory: DeviceBuffer, key: str, handle: bytes) -> None:
        self.memory, self.key, self.handle = memory, key, handle


class CudaIpcFabric(Fabric):
    """The cuda-ipc fabric of one rank (see the module docstring and README.md).

    `control`: the fabric for control messages and host-memory buffers; this fabric owns it (uses
    three of its streams per data stream, closes it). Default: a `TcpFabric` on this rank's address.
    """

    def __init__(self, table: RankTable, rank: int, *, backend: IpcBackend | None = None,
                 control: Fabric | None = None) -> None:
        super().__init__(table, rank)
        if control is None:
            from transfer.tcp.fabric import TcpFabric

            control = TcpFabric(table, rank)
        self.control = control
        self.backend: IpcBackend = backend if backend is not None else TorchIpcBackend()
        self._registered: dict[str, _Registration] = {}
        self._generations = itertools.count(1)
        self._names = itertools.count()
        self._lock = threading.Lock()  # registrations
        self._pairs: dict[tuple[int, int], Pair] = {}  # the worker's alone
        self._remotes: dict[tuple[int, str], RemoteBuffer] = {}  # (peer, key): opened once; the worker's
        self._cond = threading.Condition()
        self._inbox: list[tuple[tuple[int, int] | None, Work]] = []
        self._closed = self._stopping = False
        self._worker = threading.Thread(target=self._run, name=f"ipc-{rank}", daemon=True)
        self._worker.start()

    # buffers and layouts ------------------------------------------------------------------

    def register(self, name: str, obj: object) -> int:
        memory = self.backend.memory_of(obj)
        if memory is None:
            self._forget(name)
            return self.control.register(name, obj)
        self.control.unregister(name)
        handle = self.backend.export(memory)  # once per registration
        with self._lock:
            old = self._registered.get(name)
            self._registered[name] = _Registration(memory, f"{name}#{next(self._generations)}", handle)
        if old is not None:
            self.backend.release(old.memory)
        return memory.nbytes

    def unregister(self, name: str) -> None:
        self._forget(name)
        self.control.unregister(name)

    def _forget(self, name: str) -> None:
        with self._lock:
            old = self._registered.pop(name, None)
        if old is not None:
            self.backend.release(old.memory)

    def _device(self, name: str, segments: Segments) -> _Registration | None:
        with self._lock:
            registration = self._registered.get(name)
        if registration is not None:
            check_segments(name, registration.memory.nbytes, segments)
        return registration

    def set_layout(self, stream: int, descriptor: str) -> None:
        for inner in ControlStreams.of(stream).all():
            self.control.set_layout(inner, descriptor)

    # posting ------------------------------------------------------------------------------

    def send(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        registration = self._device(name, segments)
        if registration is None:
            return self.control.send(peer, name, segments, ControlStreams.of(stream).host, deadline)
        mark = self.backend.producer_mark(registration.memory)  # the caller's stream, now
        handle = self._handle(peer, stream, total_length(segments), "send to")
        op = SendOp(handle, registration.memory, list(segments), mark, deadline)
        return self._submit(handle, (peer, stream), lambda: self._post_send(peer, stream, op))

    def recv(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        if self._device(name, segments) is None:
            return self.control.recv(peer, name, segments, ControlStreams.of(stream).host, deadline)
        handle = self._handle(peer, stream, total_length(segments), "recv from")
        op = RecvOp(handle, name, list(segments), deadline)
        return self._submit(handle, (peer, stream), lambda: self._post_recv(peer, stream, op))

    def connect(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        # a sender talks on answer(s): its handshake surfaces a layout mismatch or a missing peer
        return self.control.connect(peer, ControlStreams.of(stream).answer, deadline)

    def refresh(self, peer: int, stream: int) -> None:
        for inner in ControlStreams.of(stream).all():
            self.control.refresh(peer, inner)

    def abort(self, peer: int, stream: int, reason: str) -> None:
        error = PeerGone(f"rank {self.rank} aborted transfers with rank {peer}, stream {stream}: {reason}")
        if not self._enqueue((peer, stream), lambda: self._drop_key(peer, stream, error)):
            self._abort_control(peer, stream, reason)

    def withdraw(self, peer: int, stream: int, handle: Handle, error: TransferError) -> bool:
        """Send CANCEL for the receive's ticket and wait (up to `WITHDRAW_WAIT_S`) for the sender's
        answer: CANCELED (no send had taken the ticket: True) or DONE (False, the bytes came)."""
        waiter = Withdrawal(error)
        if not self._enqueue((peer, stream), lambda: self._cancel(peer, stream, handle, waiter)):
            return False
        waiter.answered.wait(WITHDRAW_WAIT_S)
        return waiter.taken

    def _handle(self, peer: int, stream: int, nbytes: int, verb: str) -> Handle:
        return Handle(nbytes, f"rank {self.rank} {verb} {peer} stream {stream}",
                      lambda: self.abort(peer, stream, "deadline passed"))

    def _submit(self, handle: Handle, key: tuple[int, int], work: Work) -> Handle:
        if not self._enqueue(key, work):
            handle._fail(FabricClosed(f"rank {self.rank}: fabric closed"))
        return handle

    # the worker ---------------------------------------------------------------------------

    def _enqueue(self, key: tuple[int, int] | None, work: Work) -> bool:
        with self._cond:
            if self._stopping:
                return False
            self._inbox.append((key, work))
            self._cond.notify()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._inbox and not self._stopping:
                    copying = any(pair.answers for pair in self._pairs.values())
                    self._cond.wait(_POLL_S if copying else _IDLE_S)
                work, self._inbox = self._inbox, []
                stopping = self._stopping
            for key, item in work:
                try:
                    item()
                except TransferError as exc:  # a protocol error: the pair cannot go on
                    if key is not None:
                        self._drop_key(*key, exc)
            if stopping and not work:
                return
            for pair in list(self._pairs.values()):
                self._flush_answers(pair)
                if pair.expired():
                    where = f"rank {self.rank} with rank {pair.peer} stream {pair.stream}"
                    self._drop(pair, PeerTimeout(f"{where}: deadline passed"))

    def _pair(self, peer: int, stream: int) -> Pair:
        pair = self._pairs.get((peer, stream))
        if pair is None:
            pair = self._pairs[(peer, stream)] = Pair(peer, stream, ControlStreams.of(stream))
        return pair

    def _later(self, pair: Pair, work: Callable[[Handle], None]) -> Callable[[Handle], None]:
        """A control handle's callback that runs `work` on the worker, if the pair still lives."""
        def callback(handle: Handle) -> None:
            self._enqueue(pair.key, lambda: None if pair.dead else work(handle))

        return callback

    def _control(self, sending: bool, peer: int, stream: int, data: bytearray, deadline: Deadline) -> Handle:
        """Post one control message (a send from, or a receive into, `data`)."""
        name = f"__ipc:{next(self._names)}"
        try:
            self.control.register(name, data)
            post = self.control.send if sending else self.control.recv
            return post(peer, name, [(0, len(data))], stream, deadline)
        except TransferError as exc:
            failed = Handle(len(data), "control message")
            failed._fail(exc)
            return failed
        finally:
            self.control.unregister(name)  # the posted message keeps its own view

    # sending ------------------------------------------------------------------------------

    def _post_send(self, peer: int, stream: int, op: SendOp) -> None:
        pair = self._pair(peer, stream)
        pair.sends.append(op)
        self._read_ticket(pair)
        self._match(pair)

    def _read_ticket(self, pair: Pair) -> None:
        """Keep one receive of the peer's next ticket posted while the pair lives."""
        if pair.reading:
            return
        pair.reading = True
        header = bytearray(TICKET_HEADER.size)
        posted = self._control(False, pair.peer, pair.streams.ticket, header, Deadline.after(_FAR))
        posted.add_done_callback(self._later(pair, lambda h: self._on_header(pair, header, h)))

    def _on_header(self, pair: Pair, data: bytearray, handle: Handle) -> None:
        if handle.error is not None:
            self._drop(pair, handle.error)
            return
        header = TicketHeader.decode(data)
        if not header.body_len:
            self._on_ticket(pair, header.ticket(b""))
            return
        body = bytearray(header.body_len)
        posted = self._control(False, pair.peer, pair.streams.ticket, body, Deadline.after(_FAR))
        posted.add_done_callback(self._later(pair, lambda h: self._on_body(pair, header, body, h)))

    def _on_body(self, pair: Pair, header: TicketHeader, body: bytearray, handle: Handle) -> None:
        if handle.error is not None:
            self._drop(pair, handle.error)
            return
        self._on_ticket(pair, header.ticket(body))

    def _on_ticket(self, pair: Pair, ticket: Ticket) -> None:
        pair.reading = False
        if ticket.kind is TicketKind.CANCEL:
            waiting = next((t for t in pair.tickets if t.seq == ticket.seq), None)
            if waiting is not None:  # no send took it: take it back (else the answer is DONE)
                pair.tickets.remove(waiting)
                pair.answers.append(Answer(ticket.seq, AnswerStatus.CANCELED))
        else:
            pair.tickets.append(ticket)
        self._read_ticket(pair)
        self._match(pair)
        self._flush_answers(pair)

    def _match(self, pair: Pair) -> None:
        """Start the copies of every send that has a ticket."""
        while pair.sends and pair.tickets:
            op, ticket = pair.sends.popleft(), pair.tickets.popleft()
            if ticket.nbytes != op.handle.nbytes:
                op.handle._fail(TransferError(f"rank {self.rank}: a send of {op.handle.nbytes} bytes met a "
                                              f"receive of {ticket.nbytes} bytes on stream {pair.stream}"))
                pair.answers.append(Answer(ticket.seq, AnswerStatus.SIZE_MISMATCH))
                continue
            try:
                pair.answers.append(self._copy(pair, op, ticket))
            except Exception as exc:  # the peer's handle did not open, or the copy did not queue
                op.handle._fail(TransferError(f"rank {self.rank}: copy to rank {pair.peer} failed: {exc}"))
                pair.answers.append(Answer(ticket.seq, AnswerStatus.FAILED))
        self._flush_answers(pair)

    def _copy(self, pair: Pair, op: SendOp, ticket: Ticket) -> Answer:
        pieces = pair_pieces(op.segments, ticket.segments)
        if not pieces:
            return Answer(ticket.seq, AnswerStatus.DONE, op)
        remote = self._remote(pair.peer, ticket)
        check_segments(ticket.key, remote.nbytes, ticket.segments)
        copy = self.backend.copy(op.memory, remote, pieces, op.mark)
        return Answer(ticket.seq, AnswerStatus.DONE, op, copy, remote)

    def _remote(self, peer: int, ticket: Ticket) -> RemoteBuffer:
        remote = self._remotes.get((peer, ticket.key))
        if remote is None:
            name = ticket.key.rpartition("#")[0]
            for stale in [k for k in self._remotes if k[0] == peer and k[1].rpartition("#")[0] == name]:
                del self._remotes[stale]  # re-registered: in-flight copies keep the old one open
            remote = self._remotes[(peer, ticket.key)] = self.backend.open(ticket.handle)
        return remote

    def _flush_answers(self, pair: Pair) -> None:
        """Send the answers whose copies are done, in ticket order."""
        while pair.answers and pair.answers[0].ready():
            answer = pair.answers.popleft()
            deadline = answer.op.deadline if answer.op is not None else Deadline.after(_FAR)
            data = bytearray(encode_answer(answer.seq, answer.status))
            posted = self._control(True, pair.peer, pair.streams.answer, data, deadline)
            posted.add_done_callback(partial(self._answered, pair, answer))

    def _answered(self, pair: Pair, answer: Answer, handle: Handle) -> None:
        if answer.op is not None and answer.status is AnswerStatus.DONE:
            if handle.error is None:
                answer.op.handle._complete()
            else:
                answer.op.handle._fail(handle.error)
        if handle.error is not None:
            error = handle.error
            self._enqueue(pair.key, lambda: None if pair.dead else self._drop(pair, error))

    # receiving ----------------------------------------------------------------------------

    def _post_recv(self, peer: int, stream: int, op: RecvOp) -> None:
        pair = self._pair(peer, stream)
        op.seq, pair.next_seq = pair.next_seq, pair.next_seq + 1
        ticket = Ticket(TicketKind.TICKET, op.seq)
        if op.handle.nbytes:
            with self._lock:
                registration = self._registered.get(op.name)
            if registration is None:
                raise KeyError(f"no buffer registered as {op.name!r}")
            segments = tuple((o, n) for o, n in op.segments if n)
            ticket = Ticket(TicketKind.TICKET, op.seq, segments, registration.key, registration.handle)
        pair.recvs.append(op)
        self._send_ticket(pair, ticket, op.deadline)
        answer = bytearray(ANSWER.size)
        posted = self._control(False, peer, pair.streams.answer, answer, Deadline.after(_FAR))
        posted.add_done_callback(self._later(pair, lambda h: self._on_answer(pair, op, answer, h)))

    def _send_ticket(self, pair: Pair, ticket: Ticket, deadline: Deadline) -> None:
        def failed(handle: Handle) -> None:
            if handle.error is not None:
                self._drop(pair, handle.error)

        for part in (ticket.header(), ticket.body()):
            if part:
                posted = self._control(True, pair.peer, pair.streams.ticket, bytearray(part), deadline)
                posted.add_done_callback(self._later(pair, failed))

    def _cancel(self, peer: int, stream: int, handle: Handle, waiter: Withdrawal) -> None:
        pair = self._pairs.get((peer, stream))
        op = None if pair is None else next((op for op in pair.recvs if op.handle is handle), None)
        if pair is None or op is None or op.withdrawal is not None or handle.done():
            waiter.answer(False)
            return
        op.withdrawal = waiter
        self._send_ticket(pair, Ticket(TicketKind.CANCEL, op.seq), op.deadline)

    def _on_answer(self, pair: Pair, op: RecvOp, data: bytearray, handle: Handle) -> None:
        if handle.error is not None:
            self._drop(pair, handle.error)
            return
        seq, status = decode_answer(data)
        if not pair.recvs or pair.recvs[0] is not op or seq != op.seq:
            raise TransferError(f"rank {self.rank}: answer {seq} from rank {pair.peer} for receive {op.seq}")
        pair.recvs.popleft()
        if status is AnswerStatus.CANCELED and op.withdrawal is not None:
            op.handle._fail(op.withdrawal.error)
        elif status is AnswerStatus.DONE:
            op.handle._complete()
        else:
            op.handle._fail(TransferError(f"rank {self.rank}: rank {pair.peer} answered {status.name} to a "
                                          f"receive of {op.handle.nbytes} bytes on stream {pair.stream}"))
        if op.withdrawal is not None:
            op.withdrawal.answer(status is AnswerStatus.CANCELED)

    # failing ------------------------------------------------------------------------------

    def _drop_key(self, peer: int, stream: int, error: TransferError) -> None:
        pair = self._pairs.get((peer, stream))
        if pair is not None:
            self._drop(pair, error)
        else:
            self._abort_control(peer, stream, str(error))

    def _drop(self, pair: Pair, error: TransferError) -> None:
        """Fail everything of the pair and reset its control streams (no stale control message may
        meet a later operation); copies already queued run to their end on their own."""
        if pair.dead:
            return
        pair.dead = True
        self._pairs.pop(pair.key, None)
        for handle in pair.handles():
            handle._fail(error)
        for op in pair.recvs:
            if op.withdrawal is not None:
                op.withdrawal.answer(False)
        self._abort_control(pair.peer, pair.stream, str(error))

    def _abort_control(self, peer: int, stream: int, reason: str) -> None:
        for inner in ControlStreams.of(stream).all():
            self.control.abort(peer, inner, reason)

    def close(self) -> None:
        def drop_all() -> None:
            for pair in list(self._pairs.values()):
                self._drop(pair, FabricClosed(f"rank {self.rank}: fabric closed"))

        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._enqueue(None, drop_all)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._worker.join(timeout=10)
        self.control.close()
        with self._lock:
            registrations, self._registered = list(self._registered.values()), {}
        for registration in registrations:
            self.backend.release(registration.memory)
        self._remotes.clear()
        self.backend.close()
