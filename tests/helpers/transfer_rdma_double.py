"""A test double of the verbs backend: queue pairs in one process, RDMA writes by memmove.

Kept from RC semantics: in-order delivery per queue pair; a SEND or a WRITE_WITH_IMM consumes the
peer's oldest posted receive (waiting, like infinite RNR retry, if none is posted); an unsignaled
write completes silently; a queue pair moved to error flushes its receives, and work sent to it
fails with RETRY_EXC_ERR.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transfer.rdma.logic import LocalSegment, QpInfo, WcStatus, WritePlan


@dataclass
class DoubleCompletion:
    wr_id: int
    status: int
    imm: int | None
    byte_len: int


@dataclass
class _Qp:
    qpn: int
    owner: DoubleVerbs
    peer: int | None = None
    errored: bool = False
    recvs: deque[tuple[int, list[LocalSegment]]] = field(default_factory=deque)
    backlog: deque[tuple[list[bytes], int | None]] = field(default_factory=deque)  # arrived, no recv yet


class VerbsWorld:
    """Every double backend's queue pairs, by number."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.qps: dict[int, _Qp] = {}
        self.numbers = itertools.count(100)


class DoubleVerbs:
    """`VerbsBackend` double for one rank."""

    max_sge = 4  # small, so write planning splits gather lists in tests

    def __init__(self, world: VerbsWorld) -> None:
        self.world = world
        self.cq: deque[DoubleCompletion] = deque()
        self.keys = itertools.count(1)

    def register(self, addr: int, nbytes: int) -> tuple[int, int]:
        key = next(self.keys)
        return key, key

    def deregister(self, lkey: int) -> None:
        pass

    def create_qp(self) -> _Qp:
        with self.world.lock:
            qp = _Qp(next(self.world.numbers), self)
            self.world.qps[qp.qpn] = qp
            return qp

    def local_info(self, qp: _Qp, layout: str) -> QpInfo:
        return QpInfo(qp.qpn, 0, 1, "::", 5, layout)

    def connect(self, qp: _Qp, remote: QpInfo) -> None:
        qp.peer = remote.qpn

    def post_recv(self, qp: _Qp, wr_id: int, sges: Sequence[LocalSegment]) -> None:
        with self.world.lock:
            if qp.errored:
                self.cq.append(DoubleCompletion(wr_id, WcStatus.WR_FLUSH_ERR, None, 0))
                return
            qp.recvs.append((wr_id, list(sges)))
            while qp.backlog and qp.recvs:
                chunks, imm = qp.backlog.popleft()
                self._land(qp, chunks, imm)

    def post_send(self, qp: _Qp, wr_id: int, sges: Sequence[LocalSegment]) -> None:
        chunks = [ctypes.string_at(s.addr, s.length) for s in sges]
        self._deliver(qp, wr_id, chunks, None, signaled=True)

    def post_write(self, qp: _Qp, wr_id: int, write: WritePlan, imm: int | None, signaled: bool) -> None:
        with self.world.lock:
            target = self._target(qp)
            if target is not None:
                offset = 0
                for sge in write.sges:
                    ctypes.memmove(write.remote_addr + offset, sge.addr, sge.length)
                    offset += sge.length
        if imm is not None:
            self._deliver(qp, wr_id, [], imm, signaled)
        elif signaled or target is None:
            self._finish(qp, wr_id, target is not None)

    def _target(self, qp: _Qp) -> _Qp | None:
        target = self.world.qps.get(qp.peer) if qp.peer is not None else None
        return None if target is None or target.errored or qp.errored else target

    def _deliver(self, qp: _Qp, wr_id: int, chunks: list[bytes], imm: int | None, signaled: bool) -> None:
        with self.world.lock:
            target = self._target(qp)
            if target is not None:
                if target.recvs:
                    target.owner._land(target, chunks, imm)
                else:
                    target.backlog.append((chunks, imm))
        if signaled or target is None:
            self._finish(qp, wr_id, target is not None)

    def _finish(self, qp: _Qp, wr_id: int, ok: bool) -> None:
        status = WcStatus.SUCCESS if ok else WcStatus.RETRY_EXC_ERR
        with self.world.lock:
            self.cq.append(DoubleCompletion(wr_id, status, None, 0))

    def _land(self, qp: _Qp, chunks: list[bytes], imm: int | None) -> None:
        """Called with the world lock held: fill the oldest receive of `qp` (owned by self)."""
        wr_id, sges = qp.recvs.popleft()
        data = b"".join(chunks)
        if data:
            ctypes.memmove(sges[0].addr, data, len(data))
        self.cq.append(DoubleCompletion(wr_id, WcStatus.SUCCESS, imm, len(data)))

    def poll(self, max_entries: int) -> list[DoubleCompletion]:
        with self.world.lock:
            out = [self.cq.popleft() for _ in range(min(max_entries, len(self.cq)))]
        return out

    def error_qp(self, qp: _Qp) -> None:
        with self.world.lock:
            qp.errored = True
            for wr_id, _ in qp.recvs:
                self.cq.append(DoubleCompletion(wr_id, WcStatus.WR_FLUSH_ERR, None, 0))
            qp.recvs.clear()

    def close(self) -> None:
        pass


def make_rdma_double(n: int) -> list[Any]:
    """`n` RdmaFabrics on the verbs double."""
    from tests.helpers.transfer_fabrics import local_table
    from transfer.rdma.fabric import RdmaFabric
    from transfer.rendezvous import DictRendezvous

    table, rendezvous, world = local_table(n), DictRendezvous(), VerbsWorld()
    return [RdmaFabric(table, r, rendezvous, backend=DoubleVerbs(world)) for r in range(n)]

