"""The in-process fabric, with injectable faults, for unit tests and fault drills.

Every `FakeFabric` of one `FakeNetwork` is a rank; messages are matched per (src, dst, stream) in
posting order and copied between the registered buffers. Faults: a delay on every delivery, a
predicate that silently drops chosen messages (the receiver then hits its deadline), and peer death
after a rank has sent N bytes (the message in flight is cut short; everything pending with that
rank fails with `PeerGone`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.buffers import BufferRegistry
from transfer.core import Deadline, Handle, Rank, Segments, total_length
from transfer.errors import FabricClosed, LayoutMismatch, PeerGone, TransferError
from transfer.fabric import Fabric
from transfer.ranktable import RankTable

DropRule = Callable[[Rank, Rank, int, int], bool]  # (src, dst, stream, message seq) -> drop?


@dataclass
class FakeFaults:
    """Faults to inject; all off by default."""

    delay_s: float = 0.0
    drop: DropRule | None = None
    die_after_bytes: dict[int, int] = field(default_factory=dict)


@dataclass
class _Op:
    handle: Handle
    views: list[memoryview]
    nbytes: int


@dataclass
class _Pair:
    sends: deque[_Op] = field(default_factory=deque)
    recvs: deque[_Op] = field(default_factory=deque)
    seq: int = 0


def _copy(src: list[memoryview], dst: list[memoryview], limit: int) -> None:
    """Copy up to `limit` bytes from the gather list to the scatter list."""
    si = di = so = do = 0
    while limit > 0 and si < len(src) and di < len(dst):
        n = min(limit, len(src[si]) - so, len(dst[di]) - do)
        dst[di][do : do + n] = src[si][so : so + n]
        limit -= n
        so += n
        do += n
        if so == len(src[si]):
            si, so = si + 1, 0
        if do == len(dst[di]):
            di, do = di + 1, 0


class FakeNetwork:
    """The shared medium of a group of `FakeFabric`s; owns the delivery thread."""

    def __init__(self, faults: FakeFaults | None = None) -> None:
        self.faults = faults or FakeFaults()
        self._lock = threading.Lock()
        self._pairs: dict[tuple[Rank, Rank, int], _Pair] = {}
        self._members: dict[Rank, FakeFabric] = {}
        self._dead: set[Rank] = set()
        self._refused: dict[tuple[Rank, Rank, int], TransferError] = {}  # sticky handshake failures
        self._sent: dict[Rank, int] = {}
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closing = False

    def join(self, fabric: FakeFabric) -> None:
        with self._lock:
            self._members[fabric.rank] = fabric

    def leave(self, rank: Rank) -> None:
        """A fabric closed: fail what is pending with it; stop the delivery thread with the last one."""
        self._fail_rank(rank, PeerGone(f"rank {rank} closed its fabric"))
        with self._lock:
            self._members.pop(rank, None)
            last = not self._members
            if last:
                self._closing = True
                self._wake.notify_all()
            thread = self._thread
        if last and thread is not None:
            thread.join(timeout=5)

    def kill(self, rank: int) -> None:
        """Rank `rank` dies: everything pending with it fails, later posts to it fail at once."""
        with self._lock:
            self._dead.add(Rank(rank))
        self._fail_rank(Rank(rank), PeerGone(f"rank {rank} died"))

    def alive(self, rank: Rank) -> bool:
        with self._lock:
            return rank in self._members and rank not in self._dead

    def layout(self, rank: Rank, stream: int) -> str | None:
        with self._lock:
            member = self._members.get(rank)
        return None if member is None else member.layouts.get(stream, "")

    def post(self, src: Rank, dst: Rank, stream: int, op: _Op, sending: bool) -> None:
        """Queue a send or receive and deliver whatever now matches."""
        with self._lock:
            dead = {src, dst} & self._dead
            refused = None if sending else self._refused.get((src, dst, stream))
            if refused is not None:
                dead = set()
            elif not dead:
                pair = self._pairs.setdefault((src, dst, stream), _Pair())
                (pair.sends if sending else pair.recvs).append(op)
                matches = self._match(src, dst, stream, pair)
        if refused is not None:
            op.handle._fail(refused)
            return
        if dead:
            op.handle._fail(PeerGone(f"rank {min(dead)} is dead"))
            return
        for send, recv in matches:
            self._deliver(src, dst, stream, send, recv)

    def _match(self, src: Rank, dst: Rank, stream: int, pair: _Pair) -> list[tuple[_Op, _Op]]:
        matches = []
        while pair.sends and pair.recvs:
            send = pair.sends.popleft()
            seq, pair.seq = pair.seq, pair.seq + 1
            if self.faults.drop is not None and self.faults.drop(src, dst, stream, seq):
                send.handle._complete()  # the sender believes it went out; the receiver never hears
                continue
            matches.append((send, pair.recvs.popleft()))
        return matches

    def _deliver(self, src: Rank, dst: Rank, stream: int, send: _Op, recv: _Op) -> None:
        error: TransferError | None = None
        if self.layout(src, stream) != self.layout(dst, stream):
            error = LayoutMismatch(f"stream {stream}: rank {src} and rank {dst} have different layouts")
        elif send.nbytes != recv.nbytes:
            error = TransferError(f"{src}->{dst}: sent {send.nbytes} bytes into a {recv.nbytes}-byte receive")
        if error is not None:
            send.handle._fail(error)
            recv.handle._fail(error)
            return
        if self.faults.delay_s > 0:
            self._schedule(self.faults.delay_s, lambda: self._transfer(src, send, recv))
        else:
            self._transfer(src, send, recv)

    def _transfer(self, src: Rank, send: _Op, recv: _Op) -> None:
        limit = self.faults.die_after_bytes.get(src)
        with self._lock:
            sent = self._sent.get(src, 0)
            self._sent[src] = sent + send.nbytes
        budget = send.nbytes if limit is None else max(0, min(send.nbytes, limit - sent))
        _copy(send.views, recv.views, budget)
        if budget < send.nbytes:
            recv.handle._fail(PeerGone(f"rank {src} died mid-message"))
            self.kill(src)
            return
        send.handle._complete()
        recv.handle._complete()

    def _schedule(self, delay: float, action: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._due, (time.monotonic() + delay, next(self._ids), action))
            if self._thread is None:
                self._thread = threading.Thread(target=self._deliveries, name="fake-net", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def _deliveries(self) -> None:
        while True:
            with self._lock:
                while not self._closing and (not self._due or self._due[0][0] > time.monotonic()):
                    self._wake.wait(timeout=self._due[0][0] - time.monotonic() if self._due else None)
                if self._closing:
                    return
                _, _, action = heapq.heappop(self._due)
            action()

    def refuse(self, src: Rank, dst: Rank, stream: int, error: TransferError | None) -> None:
        """Record (or clear, with None) a failed handshake from `src` to `dst`, as the receiver sees it."""
        with self._lock:
            if error is None:
                self._refused.pop((src, dst, stream), None)
                return
            self._refused[(src, dst, stream)] = error
            pair = self._pairs.get((src, dst, stream))
            failed = list(pair.recvs) if pair else []
            if pair:
                pair.recvs.clear()
        for op in failed:
            op.handle._fail(error)

    def withdraw(self, src: Rank, dst: Rank, stream: int, handle: Handle) -> bool:
        """Remove the unmatched receive of `handle` from `src` to `dst` (False: matched or unknown)."""
        with self._lock:
            pair = self._pairs.get((src, dst, stream))
            op = next((op for op in pair.recvs if op.handle is handle), None) if pair else None
            if op is None or pair is None:
                return False
            pair.recvs.remove(op)
            return True

    def fail_pair(self, a: Rank, b: Rank, stream: int, error: TransferError) -> None:
        """`a` aborts: fail everything queued between `a` and `b` on `stream`, both directions."""
        with self._lock:
            self._refused.pop((b, a, stream), None)
            pairs = [self._pairs.pop(k) for k in ((a, b, stream), (b, a, stream)) if k in self._pairs]
        for pair in pairs:
            for op in (*pair.sends, *pair.recvs):
                op.handle._fail(error)

    def _fail_rank(self, rank: Rank, error: TransferError) -> None:
        with self._lock:
            keys = [k for k in self._pairs if rank in k[:2]]
            pairs = [self._pairs.pop(k) for k in keys]
        for pair in pairs:
            for op in (*pair.sends, *pair.recvs):
                op.handle._fail(error)


class FakeFabric(Fabric):
    """One rank on a `FakeNetwork`."""

    def __init__(self, table: RankTable, rank: int, network: FakeNetwork) -> None:
        super().__init__(table, rank)
        self.network = network
        self.buffers = BufferRegistry()
        self.layouts: dict[int, str] = {}
        self._closed = False
        network.join(self)

    def register(self, name: str, obj: object) -> int:
        return self.buffers.register(name, obj)

    def unregister(self, name: str) -> None:
        self.buffers.unregister(name)

    def set_layout(self, stream: int, descriptor: str) -> None:
        self.layouts[stream] = descriptor

    def send(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._post(Rank(peer), name, segments, stream, sending=True)

    def recv(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._post(Rank(peer), name, segments, stream, sending=False)

    def _post(self, peer: Rank, name: str, segments: Segments, stream: int, sending: bool) -> Handle:
        verb = "send to" if sending else "recv from"
        handle = Handle(total_length(segments), f"rank {self.rank} {verb} {peer} stream {stream}")
        views = self.buffers.slices(name, segments, writable=not sending)
        if self._closed:
            handle._fail(FabricClosed(f"rank {self.rank}: fabric closed"))
            return handle
        op = _Op(handle, views, handle.nbytes)
        src, dst = (self.rank, peer) if sending else (peer, self.rank)
        self.network.post(src, dst, stream, op, sending)
        return handle

    def connect(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        handle = Handle(0, f"rank {self.rank} connect to {peer} stream {stream}")
        theirs = self.network.layout(Rank(peer), stream)
        if not self.network.alive(Rank(peer)):
            handle._fail(PeerGone(f"rank {peer} is not reachable"))
        elif theirs != self.layouts.get(stream, ""):
            error = LayoutMismatch(f"stream {stream}: ranks {self.rank} and {peer} have different layouts")
            self.network.refuse(self.rank, Rank(peer), stream, error)
            handle._fail(error)
        else:
            self.network.refuse(self.rank, Rank(peer), stream, None)
            handle._complete()
        return handle

    def withdraw(self, peer: int, stream: int, handle: Handle, error: TransferError) -> bool:
        if not self.network.withdraw(Rank(peer), self.rank, stream, handle):
            return False
        handle._fail(error)
        return True

    def abort(self, peer: int, stream: int, reason: str) -> None:
        self.network.fail_pair(self.rank, Rank(peer), stream, PeerGone(f"aborted: {reason}"))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.network.leave(self.rank)
