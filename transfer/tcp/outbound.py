"""The sending side of one (peer, stream) connection: a queue of messages and its writer thread.

The writer connects lazily (retrying until the first message's deadline, since the peer may start
later), performs the handshake, then writes each message as header + gather list with `sendmsg`
straight from the registered buffers. Any failure resets the channel: the queued messages fail, the
socket is closed with a reset (so the peer notices) and the next message connects afresh.

`refresh` drops an idle connection the peer has closed or reset (a readable socket: the receiver
never writes), so that the first message of a new exchange does not fail on an old reset.

Two shortcuts save the writer thread's wake-up (and the poster's wake-up after it) on a live,
idle connection: a connect request completes at once, and a small message (up to
`INLINE_BYTES`: a migration header, a confirmation record) is written by the posting thread
itself, without blocking — if the socket has no room it is queued for the writer as usual, and
the rest of a partly written one is written with the message's deadline.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from transfer.core import Deadline, Handle
from transfer.errors import FabricClosed, PeerGone, PeerTimeout, TransferError
from transfer.ranktable import RankEntry
from transfer.tcp.liveness import PeerLiveness
from transfer.tcp.ratelimit import LinkPacer
from transfer.tcp.wire import HEADER, IOV_BATCH, MESSAGE_MAGIC, PROTOCOL_VERSION, Hello, read_reply

_RETRY_S = 0.05
# A peer whose port refuses connections this long is not starting up but gone: fail `PeerGone` then
# rather than at the message's deadline (minutes for a weight transfer, with every rank of the
# collective waiting). Peers of one cluster start within seconds of each other.
REFUSED_GRACE_S = 15.0
INLINE_BYTES = 4096  # messages up to this size may be written by the posting thread


@dataclass
class SendOp:
    """One queued message (`views is None`: a connect request, no payload)."""

    handle: Handle
    views: list[memoryview] | None
    nbytes: int
    deadline: Deadline



def hard_close(sock: socket.socket) -> None:
    """Close with a TCP reset, so the peer's blocked reads and writes fail at once."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def unblock(sock: socket.socket) -> None:
    """Wake a thread blocked on `sock` (its owner then closes it)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)


class OutboundChannel:
    """Messages from this rank to `peer` on `stream`, in posting order."""

    def __init__(
        self, me: int, peer: RankEntry, stream: int, layout: str, pacer: LinkPacer | None,
        refused_grace_s: float = REFUSED_GRACE_S, liveness: PeerLiveness | None = None,
        peer_generation: Callable[[], int | None] | None = None,
    ) -> None:
        self.me, self.peer, self.stream, self.layout, self.pacer = me, peer, stream, layout, pacer
        self.refused_grace_s = refused_grace_s
        self.liveness = liveness or PeerLiveness()  # shared by the fabric's channels
        self._queue: deque[SendOp] = deque()
        self._cond = threading.Condition()
        self._sock: socket.socket | None = None
        self._busy = False
        self._generation = 0
        # the peer's resets of this edge (`Resets.generation`), read before each connect; None: unknown
        self._peer_generation = peer_generation
        self._connected_under: int | None = None
        self._closed = False
        self._header = bytearray(HEADER.size)
        self._thread = threading.Thread(target=self._run, name=f"tcp-send-{peer.rank}-{stream}", daemon=True)
        self._thread.start()

    def post(self, op: SendOp) -> None:
        """Queue a message (or a connect request); see the module's doc for the shortcuts."""
        with self._cond:
            if self._closed:
                op.handle._fail(FabricClosed(f"rank {self.me}: fabric closed"))
                return
            sock, generation = self._sock, self._generation
            if sock is not None and op.views is None:
                inline = False  # connected already: nothing to do
            elif sock is not None and self._idle() and op.nbytes <= INLINE_BYTES and self.pacer is None:
                inline = self._busy = True
            else:
                self._queue.append(op)
                self._cond.notify()
                return
        if inline:
            self._post_inline(sock, generation, op)
        else:
            op.handle._complete()

    def _idle(self) -> bool:
        """(Holding the lock) nothing queued or being written."""
        return not self._queue and not self._busy

    def _post_inline(self, sock: socket.socket, generation: int, op: SendOp) -> None:
        """Write `op` from this thread; queue it for the writer if the socket has no room at all."""
        try:
            written = self._write_now(sock, op)
        except (OSError, TransferError) as exc:
            error = self._as_error(exc, op)
            self._fail(sock, generation, error)
            op.handle._fail(error)
            return
        with self._cond:
            self._busy = False
            aborted = generation != self._generation  # abort() only shut the socket down: close it
            if not written and not aborted:
                self._queue.appendleft(op)  # first: anything posted meanwhile came after it
            self._cond.notify()
        if aborted:
            hard_close(sock)
        if written:
            op.handle._complete()
        elif aborted:
            op.handle._fail(PeerGone(f"rank {self.me}: channel to {self.peer.rank} aborted"))

    def _write_now(self, sock: socket.socket, op: SendOp) -> bool:
        """Write header + payload without blocking; False if nothing went out (the socket is full)."""
        assert op.views is not None
        header = HEADER.pack(MESSAGE_MAGIC, op.nbytes)
        pending: list[memoryview | bytes] = [header, *op.views]
        try:
            sent = sock.sendmsg(pending, [], socket.MSG_DONTWAIT)
        except (BlockingIOError, BrokenPipeError, ConnectionResetError):
            return False  # no room, or a dead connection: the writer writes it (or fails it)
        total = len(header) + op.nbytes
        while sent < total:  # the rest of a partly written message, bounded by its deadline
            if not select.select([], [sock], [], op.deadline.remaining())[1]:
                raise PeerTimeout(f"rank {self.me} -> rank {self.peer.rank}: deadline passed while sending")
            data = b"".join(bytes(part) for part in pending)[sent:]
            pending, total, sent = [data], len(data), 0
            with contextlib.suppress(BlockingIOError):
                sent = sock.send(data, socket.MSG_DONTWAIT)
        return True

    def refresh(self) -> None:
        """Drop an idle connection the peer has closed or reset; the next message connects afresh.

        The receiver never writes on a connection after its REPLY, so a readable socket means the
        peer is gone (EOF or a reset), which a plain write would report only by failing. With the
        peer's reset count (`peer_generation`), a count that moved since the connection was made
        means the peer reset it, even while its reset is still on the way.
        """
        current = self._peer_generation() if self._peer_generation is not None else None
        with self._cond:
            sock = self._sock
            if sock is None or not self._idle():
                return
            reset_by_peer = current is not None and self._connected_under is not None \
                and current != self._connected_under
            if not reset_by_peer:
                try:
                    sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return  # nothing to read: alive
                except OSError:
                    pass  # reset
            self._generation += 1
            self._sock = None
        if not reset_by_peer:
            self.liveness.lost(self.peer.rank)  # a refused reconnect now fails at once
        hard_close(sock)

    def abort(self, error: TransferError) -> None:
        """Fail everything queued and drop the connection (the peer sees a reset)."""
        with self._cond:
            self._generation += 1
            failed = list(self._queue)
            self._queue.clear()
            sock, self._sock = self._sock, None
            if sock is not None:
                if self._busy:
                    unblock(sock)  # the writer closes it when its write fails
                else:
                    hard_close(sock)
        for op in failed:
            op.handle._fail(error)

    def close(self) -> None:
        """Fail what is queued, close the socket, join the writer."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self.abort(FabricClosed(f"rank {self.me}: fabric closed"))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or self._busy) and not self._closed:
                    self._cond.wait()  # busy: a poster writes a small message itself
                if self._closed:
                    return
                op, generation, sock = self._queue[0], self._generation, self._sock
                self._busy = True
            try:
                sock = sock or self._connect(op.deadline, generation)
                if op.views is not None:
                    self._write(sock, op)
                self._finish(op, generation)
            except (OSError, TransferError) as exc:
                if isinstance(exc, ConnectionResetError | BrokenPipeError) and generation == self._generation:
                    self.liveness.lost(self.peer.rank)  # the peer reset it (our abort bumps the generation)
                self._fail(sock, generation, self._as_error(exc, op))

    def _finish(self, op: SendOp, generation: int) -> None:
        with self._cond:
            self._busy = False
            if generation == self._generation and self._queue and self._queue[0] is op:
                self._queue.popleft()
        op.handle._complete()

    def _fail(self, sock: socket.socket | None, generation: int, error: TransferError) -> None:
        with self._cond:
            self._busy = False
            current = generation == self._generation
            if current:
                self._sock = None  # abort() already took it otherwise
        if sock is not None:
            hard_close(sock)
        if current:
            self.abort(error)

    def _as_error(self, exc: Exception, op: SendOp) -> TransferError:
        if isinstance(exc, TransferError):
            return exc
        where = f"rank {self.me} -> rank {self.peer.rank} stream {self.stream}"
        if isinstance(exc, TimeoutError) or op.deadline.expired():
            return PeerTimeout(f"{where}: deadline passed while sending")
        return PeerGone(f"{where}: connection lost ({exc})")

    def _connect(self, deadline: Deadline, generation: int) -> socket.socket:
        address = (self.peer.transfer_host, self.peer.transfer_port)
        # read before connecting: a reset after this read makes the next refresh reconnect (harmless)
        under = self._peer_generation() if self._peer_generation is not None else None
        refused_since: float | None = None
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(0.001, min(deadline.remaining(), 2.0)))
                break
            except (ConnectionRefusedError, ConnectionResetError, TimeoutError) as exc:
                if self.liveness.gone(self.peer.rank) and isinstance(exc, ConnectionRefusedError):
                    raise PeerGone(f"rank {self.peer.rank} at {address} closed a connection with us and "
                                   f"is not listening: {exc}") from exc
                if isinstance(exc, ConnectionRefusedError):
                    now = time.monotonic()
                    refused_since = now if refused_since is None else refused_since
                    if now - refused_since >= self.refused_grace_s:
                        raise PeerGone(f"rank {self.peer.rank} at {address} refused connections for "
                                       f"{self.refused_grace_s:g} s: not listening (gone?)") from exc
                else:
                    refused_since = None
                if deadline.remaining() <= _RETRY_S:
                    raise PeerTimeout(f"rank {self.peer.rank} at {address} not reachable: {exc}") from exc
                if self._closed or generation != self._generation:  # closed or aborted meanwhile
                    where = f"rank {self.me}: channel to {self.peer.rank}"
                    raise PeerGone(f"{where} aborted while connecting") from exc
                time.sleep(_RETRY_S)  # the peer may not be listening yet
        try:
            return self._handshake(sock, deadline, generation, under)
        except BaseException:
            hard_close(sock)
            raise

    def _handshake(self, sock: socket.socket, deadline: Deadline, generation: int,
                   under: int | None) -> socket.socket:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(max(0.001, deadline.remaining()))
        hello = Hello(PROTOCOL_VERSION, self.me, self.stream, self.layout)
        sock.sendall(hello.encode())
        read_reply(sock, hello, self.peer.rank)
        # Blocking from here on: one sendmsg moves a whole message inside the kernel (a timeout would
        # turn it into poll + partial sends). Deadlines are enforced by aborting the channel, which
        # shuts the socket down under a blocked sendmsg.
        sock.settimeout(None)
        with self._cond:
            if generation != self._generation:
                raise PeerGone(f"rank {self.me}: channel to {self.peer.rank} aborted while connecting")
            self._sock, self._connected_under = sock, under
        self.liveness.reached(self.peer.rank)
        return sock

    def _write(self, sock: socket.socket, op: SendOp) -> None:
        assert op.views is not None
        if self.pacer is not None:
            self.pacer.take(op.nbytes, op.deadline)
        HEADER.pack_into(self._header, 0, MESSAGE_MAGIC, op.nbytes)
        pending: list[memoryview] = [memoryview(self._header), *op.views]
        index = 0
        while index < len(pending):
            sent = sock.sendmsg(pending[index : index + IOV_BATCH])
            while sent and sent >= len(pending[index]):
                sent -= len(pending[index])
                index += 1
            if sent:
                pending[index] = pending[index][sent:]
