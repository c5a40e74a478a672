"""A test double of the NCCL backend: communicators in one process that copy host memory.

Semantics kept from NCCL: sends and receives match per (src, dst) in issue order; an event is done
only when every op issued on its stream before it has matched; an aborted communicator never
completes anything again.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np


@dataclass
class _Op:
    ptr: int
    nbytes: int
    done: bool = False


@dataclass
class _Stream:
    issued: list[_Op] = field(default_factory=list)


class _Event:
    def __init__(self, ops: list[_Op]) -> None:
        self._ops = ops

    @property
    def done(self) -> bool:
        return all(op.done for op in self._ops)


class DoubleWorld:
    """Shared state of every communicator created from the same unique ids."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[tuple[bytes, int, int], tuple[deque[_Op], deque[_Op]]] = {}
        self.aborted: set[bytes] = set()

    def post(self, uid: bytes, src: int, dst: int, op: _Op, sending: bool) -> None:
        with self.lock:
            if uid in self.aborted:
                return
            sends, recvs = self.queues.setdefault((uid, src, dst), (deque(), deque()))
            (sends if sending else recvs).append(op)
            while sends and recvs:
                send, recv = sends.popleft(), recvs.popleft()
                if send.nbytes != recv.nbytes:
                    raise AssertionError(f"NCCL double: {send.nbytes} bytes sent, {recv.nbytes} expected")
                ctypes.memmove(recv.ptr, send.ptr, send.nbytes)
                send.done = recv.done = True


class DoubleComm:
    def __init__(self, world: DoubleWorld, uid: bytes, rank: int) -> None:
        self.world, self.uid, self.rank = world, uid, rank

    def send(self, ptr: int, nbytes: int, peer: int, stream: Any) -> None:
        op = _Op(ptr, nbytes)
        stream.issued.append(op)
        self.world.post(self.uid, self.rank, peer, op, sending=True)

    def recv(self, ptr: int, nbytes: int, peer: int, stream: Any) -> None:
        op = _Op(ptr, nbytes)
        stream.issued.append(op)
        self.world.post(self.uid, peer, self.rank, op, sending=False)

    def abort(self) -> None:
        with self.world.lock:
            self.world.aborted.add(self.uid)

    def destroy(self) -> None:
        pass


class DoubleBackend:
    """`NcclBackend` over host memory (numpy arrays, bytearrays stand in for device buffers)."""

    def __init__(self, world: DoubleWorld) -> None:
        self.world = world

    def activate(self) -> None:
        pass

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def communicator(self, world: int, uid: bytes, rank: int) -> DoubleComm:
        return DoubleComm(self.world, uid, rank)

    def group_start(self) -> None:
        pass

    def group_end(self) -> None:
        pass

    def new_stream(self) -> _Stream:
        return _Stream()

    def record(self, stream: Any) -> _Event:
        ops, stream.issued = stream.issued, []
        return _Event(ops)

    def pointer(self, obj: object) -> tuple[int, int]:
        if isinstance(obj, np.ndarray):
            return int(obj.__array_interface__["data"][0]), obj.nbytes
        if isinstance(obj, bytearray):
            return ctypes.addressof((ctypes.c_char * len(obj)).from_buffer(obj)), len(obj)
        raise TypeError(f"the NCCL double takes numpy arrays and bytearrays, not {type(obj).__name__}")

    def scratch(self, nbytes: int) -> object:
        return np.zeros(nbytes, np.uint8)

    def status_of(self, exc: BaseException) -> int | None:
        return None


def make_nccl_double(n: int) -> list[Any]:
    """`n` NcclFabrics on the double, created concurrently (communicator creation is collective)."""
    from tests.helpers.transfer_fabrics import local_table, run_all
    from transfer.nccl.fabric import NcclFabric
    from transfer.rendezvous import DictRendezvous

    table, rendezvous, world = local_table(n), DictRendezvous(), DoubleWorld()
    fabrics: list[Any] = [None] * n

    def build(rank: int) -> None:
        fabrics[rank] = NcclFabric(table, rank, rendezvous, backend=DoubleBackend(world), setup_timeout_s=30)

    errors = run_all([partial(build, r) for r in range(n)])
    if any(errors):
        for fabric in fabrics:
            if fabric is not None:
                fabric.close()
        raise AssertionError(f"NCCL double set-up failed: {errors}")
    return fabrics
