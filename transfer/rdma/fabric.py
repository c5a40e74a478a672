"""`RdmaFabric`: pyverbs reliable-connected queue pairs, one per (peer, stream).

```
 recv(A) ─► ticket (seq, scatter list, rkeys) ══SEND══► A          A: send(B) waits for B's ticket
                                                                    RDMA WRITE … (gather → scatter)
 receive completes ◄══ WRITE_WITH_IMM(seq) ═══════════════════════  last write, signaled
```
Memory regions are registered once per buffer (`register`); queue-pair info (with the stream's
layout descriptor and the protocol version) is exchanged through the caller's rendezvous when a
(peer, stream) is first used; a single progress thread posts work requests and polls the
completion queue. An abort moves the queue pair to the error state (flushing it) and the next use
connects a new one (generation + 1; both sides must have aborted).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from transfer.core import Deadline, Handle, Segments, total_length
from transfer.errors import FabricClosed, LayoutMismatch, PeerGone, PeerTimeout, TransferError
from transfer.fabric import Fabric
from transfer.ranktable import RankTable
from transfer.rdma.channel import RECV_SLOTS, SLOT_BYTES, TICKET_SLOTS, Channel, RecvOp, SendOp, unpack_wr_id
from transfer.rdma.logic import LocalSegment, QpInfo, RemoteSegment, VerbsBackend, host_address, map_wc_status
from transfer.rendezvous import Rendezvous, pair_tag

_IDLE_S = 0.0005


class RdmaFabric(Fabric):
    """The RDMA fabric of one rank."""

    def __init__(
        self,
        table: RankTable,
        rank: int,
        rendezvous: Rendezvous,
        device_name: str = "",
        backend: VerbsBackend | None = None,
    ) -> None:
        super().__init__(table, rank)
        if backend is None:
            from transfer.rdma.verbs import PyverbsBackend

            backend = PyverbsBackend(device_name)
        self.backend, self.rendezvous = backend, rendezvous
        self._regions: dict[str, tuple[object, int, int, int, int]] = {}  # obj, addr, size, lkey, rkey
        self._layouts: dict[int, str] = {}
        self._channels: dict[tuple[int, int], Channel] = {}
        self._by_index: dict[int, Channel] = {}
        self._generations: dict[tuple[int, int], int] = {}
        self._tags: dict[tuple[int, int], str] = {}  # incarnations the generations count in (`pair_tag`)
        self._pending: dict[tuple[int, int], list[tuple[Handle, Callable[[Channel], None]]]] = {}
        self._connecting: set[tuple[int, int]] = set()  # one connector thread per (peer, stream)
        self._refused: dict[tuple[int, int], TransferError] = {}
        self._connectors: list[threading.Thread] = []
        self._indices = itertools.count(1)
        # (peer, stream) and the action for the progress thread; an action's protocol error drops its channel
        self._commands: queue.SimpleQueue[tuple[tuple[int, int], Callable[[], None]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._progress, name=f"rdma-{rank}", daemon=True)
        self._thread.start()

    # buffers and layouts ------------------------------------------------------------------

    def register(self, name: str, obj: object) -> int:
        addr, size = host_address(obj)
        lkey, rkey = self.backend.register(addr, size)
        with self._lock:
            old = self._regions.get(name)
            self._regions[name] = (obj, addr, size, lkey, rkey)
        if old is not None:
            self.backend.deregister(old[3])
        return size

    def unregister(self, name: str) -> None:
        with self._lock:
            old = self._regions.pop(name, None)
        if old is not None:
            self.backend.deregister(old[3])

    def set_layout(self, stream: int, descriptor: str) -> None:
        with self._lock:
            self._layouts[stream] = descriptor
            for key in [k for k in self._refused if k[1] == stream]:
                del self._refused[key]  # a new layout deserves a new handshake

    def _memory(self, name: str, segments: Segments) -> tuple[object, int, int, int]:
        with self._lock:
            if name not in self._regions:
                raise KeyError(f"no buffer registered as {name!r}")
            obj, addr, size, lkey, rkey = self._regions[name]
        for offset, length in segments:
            if offset < 0 or length < 0 or offset + length > size:
                raise ValueError(f"segment ({offset}, {length}) is outside buffer {name!r} of {size} bytes")
        return obj, addr, lkey, rkey

    # connecting ---------------------------------------------------------------------------

    def _establish(self, peer: int, stream: int, deadline: Deadline) -> None:
        """Connector thread: create and connect the queue pair, then release the queued work."""
        key = (peer, stream)
        try:
            qp, generation = self._open_qp(peer, stream, deadline)
        except TransferError as exc:
            with self._lock:
                self._connecting.discard(key)
                waiting = self._pending.pop(key, [])
                if isinstance(exc, LayoutMismatch):
                    # both sides saw it: both move to a fresh generation, and refuse further work on
                    # this (peer, stream) until an abort or a new layout, as a refused TCP handshake does
                    self._generations[key] = self._generations.get(key, 0) + 1
                    self._refused[key] = exc
            for handle, _ in waiting:
                handle._fail(exc)
            return
        with self._lock:  # install and flush under one lock: later posts queue behind these
            self._connecting.discard(key)
            channel = self._install(peer, stream, qp, generation)
            for _, action in self._pending.pop(key, []):
                self._commands.put((key, partial(action, channel)))

    def _open_qp(self, peer: int, stream: int, deadline: Deadline) -> tuple[Any, int]:
        ours = pair_tag(self.rendezvous, self.rank, peer, deadline)
        their_tag = pair_tag(self.rendezvous, peer, self.rank, deadline)
        with self._lock:
            if self._tags.get((peer, stream), "") != ours:  # either end restarted: generations afresh
                self._tags[(peer, stream)], self._generations[(peer, stream)] = ours, 0
            generation = self._generations.get((peer, stream), 0)
            layout = self._layouts.get(stream, "")
        qp = self.backend.create_qp()
        mine = self.backend.local_info(qp, layout)
        self.rendezvous.publish(_key(stream, self.rank, peer, generation) + ours, mine.to_bytes())
        their_key = _key(stream, peer, self.rank, generation) + their_tag
        theirs = QpInfo.from_bytes(self._lookup(their_key, deadline))
        if theirs.layout != layout or theirs.version != mine.version:
            self.backend.error_qp(qp)
            raise LayoutMismatch(f"stream {stream}: rank {peer} has layout {theirs.layout!r} "
                                 f"(protocol {theirs.version}), we {layout!r} (protocol {mine.version})")
        self.backend.connect(qp, theirs)
        return qp, generation

    def _lookup(self, key: str, deadline: Deadline) -> bytes:
        """Rendezvous lookup in short slices, so that `close` never waits for a whole deadline."""
        while True:
            if self._closed:
                raise FabricClosed(f"rank {self.rank}: fabric closed")
            try:
                return self.rendezvous.lookup(key, Deadline(min(deadline.at, time.monotonic() + 0.1)))
            except PeerTimeout:
                if deadline.expired():
                    raise

    def _install(self, peer: int, stream: int, qp: Any, generation: int) -> Channel:
        """Called with the lock held."""
        control = bytearray(SLOT_BYTES * (RECV_SLOTS + TICKET_SLOTS))
        addr, size = host_address(control)
        lkey, _ = self.backend.register(addr, size)
        index = next(self._indices)
        channel = Channel(self.backend, index, qp, control, lkey, addr, generation)
        self._channels[(peer, stream)] = channel
        self._by_index[index] = channel
        return channel

    # posting ------------------------------------------------------------------------------

    def _handle(self, peer: int, stream: int, nbytes: int, verb: str) -> Handle:
        return Handle(nbytes, f"rank {self.rank} {verb} {peer} stream {stream}",
                      lambda: self.abort(peer, stream, "deadline passed"))

    def _submit(self, handle: Handle, peer: int, stream: int, deadline: Deadline,
                action: Callable[[Channel], None]) -> Handle:
        """Queue `action` for the progress thread, connecting (in the background) on first use."""
        key = (peer, stream)
        with self._lock:
            if self._closed:
                handle._fail(FabricClosed(f"rank {self.rank}: fabric closed"))
                return handle
            channel = self._channels.get(key)
            refused = self._refused.get(key)
            if channel is not None:
                self._commands.put((key, partial(action, channel)))
                return handle
            if refused is None:
                self._pending.setdefault(key, []).append((handle, action))
            first = refused is None and key not in self._connecting
            if first:
                self._connecting.add(key)
                connector = threading.Thread(target=self._establish, args=(peer, stream, deadline),
                                             name=f"rdma-connect-{peer}-{stream}", daemon=True)
                self._connectors = [t for t in self._connectors if t.is_alive()] + [connector]
                connector.start()
        if refused is not None:
            handle._fail(refused)
        return handle

    def send(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        obj, addr, lkey, _ = self._memory(name, segments)
        sges = [LocalSegment(addr + o, n, lkey) for o, n in segments if n]
        handle = self._handle(peer, stream, total_length(segments), "send to")
        return self._submit(handle, peer, stream, deadline,
                            lambda ch: ch.post_send(SendOp(handle, sges, deadline, obj)))

    def recv(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        obj, addr, _, rkey = self._memory(name, segments)
        remote = [RemoteSegment(addr + o, n, rkey) for o, n in segments if n]
        handle = self._handle(peer, stream, total_length(segments), "recv from")
        return self._submit(handle, peer, stream, deadline,
                            lambda ch: ch.post_recv(RecvOp(handle, remote, deadline, obj)))

    def connect(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        handle = self._handle(peer, stream, 0, "connect to")
        return self._submit(handle, peer, stream, deadline, lambda _: handle._complete())

    def abort(self, peer: int, stream: int, reason: str) -> None:
        error = PeerGone(f"rank {self.rank} aborted transfers with rank {peer}, stream {stream}: {reason}")
        self._commands.put(((peer, stream), lambda: self._drop(peer, stream, error)))

    def _drop(self, peer: int, stream: int, error: TransferError) -> None:
        with self._lock:
            channel = self._channels.pop((peer, stream), None)
            waiting = self._pending.pop((peer, stream), []) if channel is None else []
            self._refused.pop((peer, stream), None)
        for handle, _ in waiting:  # not connected yet: fail what waits for the connection
            handle._fail(error)
        with self._lock:
            if channel is None:
                return
            self._by_index.pop(channel.index, None)
            self._generations[(peer, stream)] = channel.generation + 1
        self.backend.error_qp(channel.qp)
        self.backend.deregister(channel.control_lkey)
        for handle in channel.pending():
            handle._fail(error)

    # progress -----------------------------------------------------------------------------

    def _progress(self) -> None:
        while not self._closed:
            busy = self._run_commands()
            for completion in self.backend.poll(64):
                busy = True
                self._complete(completion.wr_id, completion.status, completion.imm)
            self._expire()
            if not busy:
                time.sleep(_IDLE_S)

    def _run_commands(self) -> bool:
        ran = False
        while True:
            try:
                key, command = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            try:
                command()
            except TransferError as exc:  # e.g. a send met a receive of another size
                self._drop(*key, exc)

    def _complete(self, wr_id: int, status: int, imm: int | None) -> None:
        index, generation, kind, slot = unpack_wr_id(wr_id)
        with self._lock:
            channel = self._by_index.get(index)
            key = next((k for k, v in self._channels.items() if v is channel), None)
        if channel is None or key is None or generation != channel.generation & 0xFF or kind == 0:
            return  # a flushed request of an aborted queue pair, or an unsignaled write
        if status != 0:
            self._drop(*key, map_wc_status(status, f"rank {self.rank} with rank {key[0]} stream {key[1]}"))
            return
        try:
            channel.on_completion(kind, slot, imm)
        except TransferError as exc:
            self._drop(*key, exc)

    def _expire(self) -> None:
        with self._lock:
            expired = [key for key, channel in self._channels.items() if channel.expired()]
        for peer, stream in expired:
            where = f"rank {self.rank} with rank {peer} stream {stream}"
            self._drop(peer, stream, PeerTimeout(f"{where}: deadline passed"))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            keys = list(self._channels)
        for key in keys:
            self._commands.put((key, partial(self._drop, key[0], key[1], FabricClosed("fabric closed"))))
        deadline = time.monotonic() + 5
        while not self._commands.empty() and time.monotonic() < deadline:
            time.sleep(0.001)
        self._closed = True
        self._thread.join(timeout=10)
        for connector in self._connectors:
            connector.join(timeout=10)
        self.backend.close()


def _key(stream: int, src: int, dst: int, generation: int) -> str:
    return f"rdma/qp/{stream}/{src}->{dst}/{generation}"
