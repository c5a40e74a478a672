"""The receiving side of one (peer, stream): posted receives and the reader of the live connection.

The reader thread reads a message header, waits for the oldest posted receive, checks the sizes
agree and scatters the payload with `recv_into` / `recvmsg_into` straight into the registered
buffer. A lost connection fails the pending receives with `PeerGone`; a receive posted later waits for
the peer to connect again (it may be restarting), bounded by the caller's deadline. A refused
handshake (layout mismatch) is remembered instead, and fails receives until a good handshake or an
abort, so both sides of a mismatch see `LayoutMismatch`. A receive the reader has not started
to fill can be withdrawn (`withdraw`): it leaves the queue and the connection stays up, so a
caller that gives up on a message that never came does not reset the peer's connection.

Small messages (up to `EARLY_BYTES`, e.g. a migration header or a confirmation record) that arrive
before their receive is posted are read ahead into a bytes object of their own (at most
`EARLY_MESSAGES` of them); the receive posted for one then completes at once, in the posting
thread, with a copy — no wake-up of the reader thread and back, which on a busy machine costs
more than the message itself. Order is kept: early messages exist only while no receive waits,
and a receive takes the oldest one. They belong to their connection: an abort, a lost or a
replaced connection drops them.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from dataclasses import dataclass

from transfer.core import Handle
from transfer.errors import FabricClosed, PeerGone, TransferError
from transfer.tcp.liveness import PeerLiveness
from transfer.tcp.outbound import hard_close, unblock
from transfer.tcp.wire import HEADER, IOV_BATCH, MESSAGE_MAGIC

EARLY_BYTES = 64 << 10  # messages up to this size may be read before their receive is posted
EARLY_MESSAGES = 64  # at most this many per channel; more wait in the socket, as big ones do


@dataclass
class RecvOp:
    """One posted receive."""

    handle: Handle
    views: list[memoryview]
    nbytes: int


class _Connection:
    """One accepted socket and its reader thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.retired = False
        self.thread: threading.Thread | None = None


class InboundChannel:
    """Messages from `peer` to this rank on `stream`, matched to receives in posting order."""

    def __init__(self, me: int, peer: int, stream: int, liveness: PeerLiveness | None = None) -> None:
        self.me, self.peer, self.stream = me, peer, stream
        self.liveness = liveness or PeerLiveness()  # shared by the fabric's channels
        self._recvs: deque[RecvOp] = deque()
        self._cond = threading.Condition()
        self._conn: _Connection | None = None
        self._early: deque[bytearray] = deque()  # small messages read before any receive was posted
        self._filling: RecvOp | None = None  # the receive the reader is reading a payload into
        self._lost: TransferError | None = None
        self._closed = False
        self._header = bytearray(HEADER.size)
        self._threads: list[threading.Thread] = []

    def post(self, op: RecvOp) -> None:
        """Queue a receive (fails at once if the peer's connection was lost since the last one).

        If its message arrived already (a small one, read ahead), it completes here and now.
        """
        early = None
        with self._cond:
            error = self._lost if self._conn is None else None
            if self._closed:
                error = FabricClosed(f"rank {self.me}: fabric closed")
            if error is None:
                if self._early:
                    early = self._early.popleft()
                else:
                    self._recvs.append(op)
                    self._cond.notify_all()
        if error is not None:
            op.handle._fail(error)
        elif early is not None:
            self._deliver(op, early)

    def _deliver(self, op: RecvOp, data: bytearray) -> None:
        """Complete `op` with a message read ahead (a size mismatch fails the channel, as in the reader)."""
        if len(data) != op.nbytes:
            where = f"rank {self.peer} stream {self.stream}"
            error = PeerGone(f"{where} sent {len(data)} bytes into a {op.nbytes}-byte receive")
            self.abort(error)
            op.handle._fail(error)
            return
        offset = 0
        for view in op.views:
            view[:] = data[offset : offset + len(view)]
            offset += len(view)
        op.handle._complete()

    def withdraw(self, handle: Handle, error: TransferError) -> bool:
        """Take back the pending receive of `handle` unless the reader started filling it.

        The connection and any message read ahead stay: the next message goes to the next receive.
        """
        with self._cond:
            op = next((op for op in self._recvs if op.handle is handle), None)
            if op is None or op is self._filling:
                return False
            self._recvs.remove(op)
        handle._fail(error)
        return True

    def refuse(self, error: TransferError) -> None:
        """A handshake from the peer was refused (layout): fail pending receives and remember it."""
        with self._cond:
            self._lost = error
            failed = self._take_all()
        for op in failed:
            op.handle._fail(error)

    def attach(self, sock: socket.socket) -> None:
        """Start reading a freshly accepted, handshaken connection (replacing an older one)."""
        conn = _Connection(sock)
        with self._cond:
            if self._closed:
                hard_close(sock)
                return
            old, self._conn, self._lost = self._conn, conn, None
            self._early.clear()
            if old is not None:
                old.retired = True
                unblock(old.sock)
            self._threads = [t for t in self._threads if t.is_alive()]
            conn.thread = threading.Thread(
                target=self._read_loop, args=(conn,), name=f"tcp-recv-{self.peer}-{self.stream}", daemon=True
            )
            self._threads.append(conn.thread)
            self._cond.notify_all()
        conn.thread.start()
        self.liveness.reached(self.peer)

    def abort(self, error: TransferError) -> None:
        """Fail pending receives and reset the connection; the next receive waits for a new one."""
        with self._cond:
            failed = self._take_all()
            conn, self._conn, self._lost = self._conn, None, None
            if conn is not None:
                conn.retired = True
                unblock(conn.sock)
            self._cond.notify_all()
        for op in failed:
            op.handle._fail(error)

    def close(self) -> None:
        """Fail pending receives, close the connection, join the readers."""
        with self._cond:
            self._closed = True
        self.abort(FabricClosed(f"rank {self.me}: fabric closed"))
        for thread in list(self._threads):
            thread.join(timeout=10)

    def _take_all(self) -> list[RecvOp]:
        """(Holding the lock) the pending receives, removed; the connection's early messages dropped."""
        failed = list(self._recvs)
        self._recvs.clear()
        self._early.clear()
        self._filling = None
        return failed

    def _read_loop(self, conn: _Connection) -> None:
        try:
            while True:
                nbytes = self._read_header(conn.sock)
                if self._read_early(conn, nbytes):
                    continue
                op = self._next_recv(conn)
                if op is None:
                    return
                self._read_payload(conn, op, nbytes)
        except (OSError, TransferError) as exc:
            self._connection_lost(conn, exc)
        finally:
            hard_close(conn.sock)

    def _read_header(self, sock: socket.socket) -> int:
        view = memoryview(self._header)
        got = 0
        while got < HEADER.size:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise PeerGone(f"rank {self.peer} closed stream {self.stream}")
            got += k
        magic, nbytes = HEADER.unpack(self._header)
        if magic != MESSAGE_MAGIC:
            raise TransferError(f"rank {self.peer} stream {self.stream}: corrupt message header")
        return int(nbytes)

    def _read_early(self, conn: _Connection, nbytes: int) -> bool:
        """Read a small message that nobody waits for yet into a buffer of its own (False: not done)."""
        with self._cond:
            busy = bool(self._recvs) or len(self._early) >= EARLY_MESSAGES
            if busy or nbytes > EARLY_BYTES or self._conn is not conn:
                return False
        data = bytearray(nbytes)
        view, got = memoryview(data), 0
        while got < nbytes:
            k = conn.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
            if k == 0:
                raise PeerGone(f"rank {self.peer} closed stream {self.stream} mid-message")
            got += k
        with self._cond:
            if conn.retired or self._conn is not conn:
                return True  # aborted, lost or replaced meanwhile: its messages are dropped
            op = self._recvs.popleft() if self._recvs else None  # posted while we were reading
            if op is None:
                self._early.append(data)
        if op is not None:
            self._deliver(op, data)
        return True

    def _next_recv(self, conn: _Connection) -> RecvOp | None:
        with self._cond:
            while not self._recvs and not conn.retired:
                self._cond.wait()
            if conn.retired:
                return None
            self._filling = self._recvs[0]  # from now on it cannot be withdrawn
            return self._filling

    def _read_payload(self, conn: _Connection, op: RecvOp, nbytes: int) -> None:
        if nbytes != op.nbytes:
            raise TransferError(
                f"rank {self.peer} stream {self.stream} sent {nbytes} bytes into a {op.nbytes}-byte receive"
            )
        views = list(op.views)
        index = 0
        while index < len(views):
            # MSG_WAITALL: the kernel fills the buffers completely in one call (barring a signal,
            # an error or the connection ending), instead of a Python loop over partial reads
            if index + 1 == len(views):
                got = conn.sock.recv_into(views[index], 0, socket.MSG_WAITALL)
            else:
                got = conn.sock.recvmsg_into(views[index : index + IOV_BATCH], 0, socket.MSG_WAITALL)[0]
            if got == 0:
                raise PeerGone(f"rank {self.peer} closed stream {self.stream} mid-message")
            while got and got >= len(views[index]):
                got -= len(views[index])
                index += 1
            if got:
                views[index] = views[index][got:]
        with self._cond:
            if self._recvs and self._recvs[0] is op:
                self._recvs.popleft()
            if self._filling is op:
                self._filling = None
        op.handle._complete()

    def _connection_lost(self, conn: _Connection, exc: Exception) -> None:
        if not isinstance(exc, TransferError):
            exc = PeerGone(f"rank {self.peer}: connection lost ({exc})")
        error = exc
        with self._cond:
            if conn.retired:
                return  # replaced or aborted on purpose: nothing to report
            self._conn = None
            failed = self._take_all()
        self.liveness.lost(self.peer)  # closed or reset from its side
        for op in failed:
            op.handle._fail(error if isinstance(error, PeerGone) else PeerGone(str(error)))
