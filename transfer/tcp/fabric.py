"""`TcpFabric`: the CPU fabric over TCP, one connection per (peer, stream, direction).

```
   rank A                                     rank B
   send(B, s) ─► OutboundChannel(B, s) ══TCP══► listener ─► InboundChannel(A, s) ◄─ recv(A, s)
                 writer thread, sendmsg            handshake   reader thread, recv_into
```
The sender connects (lazily, retrying until the deadline) and says HELLO (rank, stream, protocol
version, layout); the receiver's listener checks it and hands the socket to the inbound channel.
Emulated links: `inter_node_gbps` (or the rank's `link_gbps` in the table) paces traffic to other
nodes, `intra_node_gbps` traffic to the same node; each is one pacer shared by all this rank's
connections, like one NIC.

With `resets` (the rank table's store), an abort is counted there before it returns, and `refresh`
compares the peer's count with the one its connection was made under (`Resets`): a retry right after
the peer reset the connection connects afresh even when the reset itself is still on its way.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from transfer.buffers import BufferRegistry
from transfer.core import Deadline, Handle, Rank, Segments, total_length
from transfer.errors import FabricClosed, LayoutMismatch, PeerGone, TransferError
from transfer.fabric import Fabric
from transfer.ranktable import RankTable
from transfer.rendezvous import Resets
from transfer.tcp.inbound import InboundChannel, RecvOp
from transfer.tcp.liveness import PeerLiveness
from transfer.tcp.outbound import REFUSED_GRACE_S, OutboundChannel, SendOp, hard_close
from transfer.tcp.ratelimit import LinkPacer
from transfer.tcp.wire import PROTOCOL_VERSION, Hello, HelloStatus, read_hello, write_reply

_HANDSHAKE_TIMEOUT_S = 5.0
log = logging.getLogger(__name__)


class TcpFabric(Fabric):
    """The TCP fabric of one rank; thread-safe."""

    def __init__(
        self,
        table: RankTable,
        rank: int,
        inter_node_gbps: float = 0.0,
        intra_node_gbps: float = 0.0,
        refused_grace_s: float = REFUSED_GRACE_S,
        resets: Resets | None = None,
    ) -> None:
        super().__init__(table, rank)
        self._refused_grace_s = refused_grace_s
        self._resets = resets
        self._liveness = PeerLiveness()  # a peer that left and refuses connections is gone at once
        self.buffers = BufferRegistry()
        self._layouts: dict[int, str] = {}
        self._outbound: dict[tuple[Rank, int], OutboundChannel] = {}
        self._inbound: dict[tuple[Rank, int], InboundChannel] = {}
        self._lock = threading.Lock()
        self._closed = False
        inter = inter_node_gbps or table[rank].link_gbps
        self._inter = LinkPacer(inter) if inter > 0 else None
        self._intra = LinkPacer(intra_node_gbps) if intra_node_gbps > 0 else None
        self._listener = self._listen()
        self._accepting = threading.Thread(target=self._accept_loop, name=f"tcp-listen-{rank}", daemon=True)
        self._accepting.start()

    def _listen(self) -> socket.socket:
        entry = self.table[self.rank]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((entry.transfer_host, entry.transfer_port))
        except OSError:
            sock.close()
            raise
        sock.listen(128)
        sock.settimeout(0.2)  # the accept loop polls the closed flag
        return sock

    @property
    def counts_resets(self) -> bool:
        """Whether aborts are counted in edge generations (`resets`), so a retry never meets a reset."""
        return self._resets is not None

    # buffers and layouts ------------------------------------------------------------------

    def register(self, name: str, obj: object) -> int:
        return self.buffers.register(name, obj)

    def unregister(self, name: str) -> None:
        self.buffers.unregister(name)

    def set_layout(self, stream: int, descriptor: str) -> None:
        with self._lock:
            self._layouts[stream] = descriptor
            stale = [ch for (_, s), ch in self._outbound.items() if s == stream]
        for channel in stale:
            channel.layout = descriptor
            channel.abort(LayoutMismatch(f"stream {stream}: layout changed to {descriptor!r}"))

    # posting ------------------------------------------------------------------------------

    def send(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        views = self.buffers.slices(name, segments, writable=False)
        handle = self._handle(peer, stream, total_length(segments), "send to")
        self._out(Rank(peer), stream).post(SendOp(handle, views, handle.nbytes, deadline))
        return handle

    def recv(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        views = self.buffers.slices(name, segments, writable=True)
        handle = self._handle(peer, stream, total_length(segments), "recv from")
        self._in(Rank(peer), stream).post(RecvOp(handle, views, handle.nbytes))
        return handle

    def connect(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        handle = self._handle(peer, stream, 0, "connect to")
        self._out(Rank(peer), stream).post(SendOp(handle, None, 0, deadline))
        return handle

    def _handle(self, peer: int, stream: int, nbytes: int, verb: str) -> Handle:
        def expire() -> None:
            self.abort(peer, stream, "deadline passed")

        return Handle(nbytes, f"rank {self.rank} {verb} {peer} stream {stream}", expire)

    def abort(self, peer: int, stream: int, reason: str) -> None:
        with self._lock:
            out = self._outbound.get((Rank(peer), stream))
            inn = self._inbound.get((Rank(peer), stream))
        error = PeerGone(f"rank {self.rank} aborted transfers with rank {peer}, stream {stream}: {reason}")
        if out is not None:
            out.abort(error)
        if inn is not None:
            inn.abort(error)
        if self._resets is not None:
            try:
                self._resets.note_reset(self.rank, peer, stream)
            except Exception as exc:  # the store is gone: the peer falls back to what its socket says
                log.warning("rank %d: could not count the reset of stream %d with rank %d: %s",
                            self.rank, stream, peer, exc)

    def refresh(self, peer: int, stream: int) -> None:
        with self._lock:
            out = self._outbound.get((Rank(peer), stream))
        if out is not None:
            out.refresh()

    def _generation_reader(self, peer: int, stream: int) -> Callable[[], int | None] | None:
        """How the channel to `peer` on `stream` reads the peer's resets of that edge (None: unknown)."""
        resets = self._resets
        if resets is None:
            return None

        def read() -> int | None:
            try:
                return resets.generation(peer, self.rank, stream)
            except Exception as exc:
                log.warning("rank %d: could not read rank %d's resets of stream %d: %s",
                            self.rank, peer, stream, exc)
                return None

        return read

    def withdraw(self, peer: int, stream: int, handle: Handle, error: TransferError) -> bool:
        with self._lock:
            inn = self._inbound.get((Rank(peer), stream))
        return inn is not None and inn.withdraw(handle, error)

    def _out(self, peer: Rank, stream: int) -> OutboundChannel:
        with self._lock:
            if self._closed:
                raise FabricClosed(f"rank {self.rank}: fabric closed")
            channel = self._outbound.get((peer, stream))
            if channel is None:
                pacer = self._intra if self.table.same_node(self.rank, peer) else self._inter
                layout = self._layouts.get(stream, "")
                channel = OutboundChannel(self.rank, self.table[peer], stream, layout, pacer,
                                          self._refused_grace_s, self._liveness,
                                          self._generation_reader(peer, stream))
                self._outbound[(peer, stream)] = channel
            return channel

    def _in(self, peer: Rank, stream: int) -> InboundChannel:
        with self._lock:
            if self._closed:
                raise FabricClosed(f"rank {self.rank}: fabric closed")
            channel = self._inbound.get((peer, stream))
            if channel is None:
                channel = InboundChannel(self.rank, peer, stream, self._liveness)
                self._inbound[(peer, stream)] = channel
            return channel

    # accepting ----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            try:
                self._admit(sock)
            except Exception:  # a bad or half-open connection must never stop the listener
                hard_close(sock)

    def _admit(self, sock: socket.socket) -> None:
        sock.settimeout(_HANDSHAKE_TIMEOUT_S)
        hello = read_hello(sock)
        status = self._judge(hello)
        with self._lock:
            layout = self._layouts.get(hello.stream, "")
        write_reply(sock, status, layout)
        if status == HelloStatus.UNKNOWN_RANK:
            hard_close(sock)
            return
        channel = self._in(Rank(hello.rank), hello.stream)
        if status != HelloStatus.OK:
            channel.refuse(LayoutMismatch(f"stream {hello.stream}: rank {hello.rank} sent layout "
                                          f"{hello.layout!r} (version {hello.version}), we have {layout!r}"))
            hard_close(sock)
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel.attach(sock)

    def _judge(self, hello: Hello) -> HelloStatus:
        if hello.rank not in self.table or hello.rank == self.rank:
            return HelloStatus.UNKNOWN_RANK
        if hello.version != PROTOCOL_VERSION:
            return HelloStatus.BAD_VERSION
        with self._lock:
            ours = self._layouts.get(hello.stream, "")
        return HelloStatus.OK if hello.layout == ours else HelloStatus.LAYOUT_MISMATCH

    # closing ------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outbound, inbound = list(self._outbound.values()), list(self._inbound.values())
        self._accepting.join(timeout=5)
        self._listener.close()
        for out in outbound:
            out.close()
        for inn in inbound:
            inn.close()
