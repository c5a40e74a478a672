"""`NcclFabric`: one two-rank NCCL communicator per (peer, stream, direction), like the TCP
fabric's connections, each with its own CUDA stream and worker thread.

```
 send(B, s) ──► edge A→B/s: ncclGroupStart; ncclSend per segment; ncclGroupEnd; record event
 recv(A, s) ──► edge A→B/s on B: the same with ncclRecv;  the worker polls events in order
```
One communicator per direction keeps every edge independent, as on TCP: a group of receives never
waits behind a send that depends on them. The sender publishes the edge's unique id through the
caller's `Rendezvous`; both sides create the communicator lazily (or at start for intra-node
peers: the warm-up exchanges a byte with each so scaling never pays connection set-up). Layout
descriptors are published through the rendezvous and checked before the first transfer with a
peer. NCCL cannot cancel one operation: a deadline or an abort aborts the edge's communicator and
the next use creates a new one (generation + 1; both sides must have aborted).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.core import Deadline, Handle, Segments, all_of, total_length
from transfer.errors import FabricClosed, LayoutMismatch, PeerGone, PeerTimeout, TransferError
from transfer.fabric import Fabric
from transfer.nccl.logic import (
    DoneEvent,
    NcclBackend,
    NcclComm,
    device_pieces,
    edge_key,
    group,
    layout_key,
    map_nccl_error,
    warmup_peers,
)
from transfer.ranktable import RankTable
from transfer.rendezvous import Rendezvous, pair_tag

_POLL_S = 0.0002


@dataclass
class _Op:
    handle: Handle
    pieces: list[tuple[int, int]]
    deadline: Deadline
    owner: object = None  # the registered buffer: device memory must outlive the operation


class _Edge:
    """One direction between this rank and a peer on one stream."""

    def __init__(self, backend: NcclBackend, rendezvous: Rendezvous, src: int, dst: int, stream: int,
                 sending: bool) -> None:
        self.backend, self.rendezvous = backend, rendezvous
        self.src, self.dst, self.stream, self.sending = src, dst, stream, sending
        self.generation = 0
        self._tag = ""  # the incarnations of both ends the generations count in (`pair_tag`)
        self._comm: NcclComm | None = None
        self._cuda_stream: object | None = None
        self._queue: list[_Op] = []
        self._in_flight: list[tuple[DoneEvent, _Op]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"nccl-{src}-{dst}-{stream}", daemon=True)
        self._thread.start()

    def post(self, op: _Op) -> None:
        with self._cond:
            if not self._closed:
                self._queue.append(op)
                self._cond.notify()
                return
        op.handle._fail(FabricClosed("fabric closed"))

    def _run(self) -> None:
        self.backend.activate()  # CUDA's current device is per thread
        while True:
            with self._cond:
                while not self._queue and not self._in_flight and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch, self._queue = self._queue, []
            try:
                for op in batch:
                    self._issue(op)
                self._poll()
            except TransferError as exc:
                self.abort(exc, batch)
            except Exception as exc:  # NCCL raises its own error type: map it
                self.abort(map_nccl_error(self.backend.status_of(exc), self._describe()), batch)

    def _describe(self) -> str:
        return f"NCCL {self.src}->{self.dst} stream {self.stream}"

    def _connect(self, deadline: Deadline) -> NcclComm:
        if self._comm is None:
            tag = pair_tag(self.rendezvous, self.src, self.dst, deadline)
            if tag != self._tag:  # either end restarted since: both count generations afresh
                self._tag, self.generation = tag, 0
            key = edge_key(self.stream, self.src, self.dst, self.generation) + tag
            if self.sending:
                self.rendezvous.publish(key, self.backend.unique_id())
            uid = self.rendezvous.lookup(key, deadline)
            self._cuda_stream = self.backend.new_stream()
            self._comm = self.backend.communicator(2, uid, 0 if self.sending else 1)
        return self._comm

    def _issue(self, op: _Op) -> None:
        comm = self._connect(op.deadline)
        with group(self.backend):
            for ptr, nbytes in op.pieces:
                if self.sending:
                    comm.send(ptr, nbytes, 1, self._cuda_stream)
                else:
                    comm.recv(ptr, nbytes, 0, self._cuda_stream)
        event = self.backend.record(self._cuda_stream)
        with self._cond:
            self._in_flight.append((event, op))

    def _poll(self) -> None:
        with self._cond:
            in_flight = list(self._in_flight)
        while in_flight and in_flight[0][0].done:  # events complete in stream order
            event, op = in_flight.pop(0)
            with self._cond:
                self._in_flight.remove((event, op))
            op.handle._complete()
        if any(op.deadline.expired() for _, op in in_flight):
            raise PeerTimeout(f"{self._describe()}: deadline passed")
        if in_flight:
            threading.Event().wait(_POLL_S)

    def abort(self, error: TransferError, extra: Sequence[_Op] = ()) -> None:
        """Fail everything and abort the communicator; the next use creates a new one."""
        with self._cond:
            ops = [*extra, *self._queue, *(op for _, op in self._in_flight)]
            self._queue, self._in_flight = [], []
            comm, self._comm = self._comm, None
            if comm is not None:
                self.generation += 1
        if comm is not None:
            with contextlib.suppress(Exception):  # aborting a failed communicator may report the failure
                comm.abort()
        for op in ops:
            op.handle._fail(error)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self.abort(FabricClosed("fabric closed"))
        self._thread.join(timeout=10)


class NcclFabric(Fabric):
    """The NCCL fabric of one rank (device buffers: cupy arrays, CUDA torch tensors)."""

    def __init__(
        self,
        table: RankTable,
        rank: int,
        rendezvous: Rendezvous,
        device: int = 0,
        backend: NcclBackend | None = None,
        warmup_streams: Sequence[int] = (0, 1, 2),
        setup_timeout_s: float = 120.0,
    ) -> None:
        super().__init__(table, rank)
        if backend is None:
            from transfer.nccl.backend import CupyBackend

            backend = CupyBackend(device)
        self.backend, self.rendezvous = backend, rendezvous
        self._buffers: dict[str, tuple[object, int, int]] = {}
        self._layouts: dict[int, str] = {}
        self._peer_layouts: dict[int, dict[int, str]] = {}
        self._edges: dict[tuple[int, int, bool], _Edge] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._publish_layouts()
        self._warm_up(warmup_streams, Deadline.after(setup_timeout_s))

    def _warm_up(self, streams: Sequence[int], deadline: Deadline) -> None:
        peers = warmup_peers(self.table, self.rank)
        if not peers or not streams:
            return
        scratch = self.backend.scratch(2 * len(peers))
        base, _ = self.backend.pointer(scratch)
        handles = []  # `scratch` stays referenced until every handle is done
        for stream in streams:  # the tiny control edges are left to connect on first use
            for i, peer in enumerate(peers):
                handles.append(self._post(peer, stream, [(base + 2 * i, 1)], True, deadline))
                handles.append(self._post(peer, stream, [(base + 2 * i + 1, 1)], False, deadline))
        for handle in handles:
            handle.wait(deadline)

    # buffers and layouts ------------------------------------------------------------------

    def register(self, name: str, obj: object) -> int:
        ptr, nbytes = self.backend.pointer(obj)
        with self._lock:
            self._buffers[name] = (obj, ptr, nbytes)
        return nbytes

    def unregister(self, name: str) -> None:
        with self._lock:
            self._buffers.pop(name, None)

    def set_layout(self, stream: int, descriptor: str) -> None:
        with self._lock:
            self._layouts[stream] = descriptor
        self._publish_layouts()

    def _publish_layouts(self) -> None:
        with self._lock:
            text = json.dumps({str(k): v for k, v in self._layouts.items()})
        self.rendezvous.publish(layout_key(self.rank), text.encode())

    def _check_layout(self, peer: int, stream: int, deadline: Deadline, refresh: bool = False) -> None:
        with self._lock:
            theirs = None if refresh else self._peer_layouts.get(peer)
            ours = self._layouts.get(stream, "")
        if theirs is None:
            raw = json.loads(self.rendezvous.lookup(layout_key(peer), deadline))
            theirs = {int(k): str(v) for k, v in raw.items()}
            with self._lock:
                self._peer_layouts[peer] = theirs
        if theirs.get(stream, "") != ours:
            other = theirs.get(stream, "")
            raise LayoutMismatch(f"stream {stream}: rank {peer} has layout {other!r}, we {ours!r}")

    def _pieces(self, name: str, segments: Segments) -> tuple[object, list[tuple[int, int]]]:
        with self._lock:
            if name not in self._buffers:
                raise KeyError(f"no buffer registered as {name!r}")
            owner, base, size = self._buffers[name]
        for offset, length in segments:
            if offset < 0 or length < 0 or offset + length > size:
                raise ValueError(f"segment ({offset}, {length}) is outside buffer {name!r} of {size} bytes")
        return owner, device_pieces(base, [s for s in segments if s[1]])

    # posting ------------------------------------------------------------------------------

    def _edge(self, peer: int, stream: int, sending: bool) -> _Edge:
        with self._lock:
            if self._closed:
                raise FabricClosed(f"rank {self.rank}: fabric closed")
            key = (peer, stream, sending)
            if key not in self._edges:
                src, dst = (self.rank, peer) if sending else (peer, self.rank)
                self._edges[key] = _Edge(self.backend, self.rendezvous, src, dst, stream, sending)
            return self._edges[key]

    def _post(self, peer: int, stream: int, pieces: list[tuple[int, int]], sending: bool,
              deadline: Deadline, owner: object = None) -> Handle:
        verb = "send to" if sending else "recv from"
        handle = Handle(sum(n for _, n in pieces), f"rank {self.rank} {verb} {peer} stream {stream}",
                        lambda: self.abort(peer, stream, "deadline passed"))
        self._edge(peer, stream, sending).post(_Op(handle, pieces, deadline, owner))
        return handle

    def _transfer(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline,
                  sending: bool) -> Handle:
        owner, pieces = self._pieces(name, segments)
        try:
            self._check_layout(peer, stream, deadline)
        except TransferError as exc:
            handle = Handle(total_length(segments), f"rank {self.rank} with {peer} stream {stream}")
            handle._fail(exc)
            return handle
        return self._post(peer, stream, pieces, sending, deadline, owner)

    def send(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._transfer(peer, name, segments, stream, deadline, sending=True)

    def recv(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._transfer(peer, name, segments, stream, deadline, sending=False)

    def connect(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        handle = Handle(0, f"rank {self.rank} connect to {peer} stream {stream}")
        try:
            self._check_layout(peer, stream, deadline, refresh=True)
        except TransferError as exc:
            handle._fail(exc)
            return handle
        handle._complete()  # the communicator itself is created with the first message
        return handle

    def warm(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        """Create both communicators of the pair on `stream` (an empty group each: no bytes move);
        the peer warms towards this rank at the same time. NCCL's own set-up is not bounded by the
        deadline (as on a first message): a peer that never warms leaves this edge's thread waiting."""
        ops = [self._post(peer, stream, [], sending, deadline) for sending in (True, False)]
        return all_of(ops, f"rank {self.rank} warm {peer} stream {stream}")

    def abort(self, peer: int, stream: int, reason: str) -> None:
        error = PeerGone(f"rank {self.rank} aborted transfers with rank {peer}, stream {stream}: {reason}")
        with self._lock:
            edges = [self._edges.get((peer, stream, sending)) for sending in (True, False)]
        for edge in edges:
            if edge is not None:
                edge.abort(error)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            edges = list(self._edges.values())
        for edge in edges:
            edge.close()
