"""Rendezvous: how the device fabrics exchange set-up data (NCCL unique ids, RDMA queue-pair info).

The caller provides it (over its control plane: the router, a shared filesystem, a key-value
store). Three implementations ship: `DictRendezvous` (one process, tests), `FileRendezvous` (a
directory every rank can see, e.g. a shared filesystem under Slurm, or /tmp for a local cluster) and
`transfer.store.StoreRendezvous` (a `torch.distributed.TCPStore`, with incarnations).

A rendezvous that also knows incarnations (`Incarnations`: how many times each rank has started)
lets the fabrics key their set-up data by the incarnations of both ends (`pair_tag`), so a restarted
rank never meets the ids its previous life published; the others tag nothing.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from transfer.core import Deadline
from transfer.errors import PeerTimeout

_POLL_S = 0.02


class Rendezvous(Protocol):
    """Publish a value under a key; look a key up, waiting until it is published or the deadline."""

    def publish(self, key: str, value: bytes) -> None:
        """Make `value` visible to every rank under `key`."""

    def lookup(self, key: str, deadline: Deadline) -> bytes:
        """The value under `key`; `PeerTimeout` if nobody published it by the deadline."""


@runtime_checkable
class Incarnations(Protocol):
    """A rendezvous that knows each rank's incarnation (bumped every time the rank starts)."""

    def incarnation_of(self, rank: int, deadline: Deadline) -> int:
        """`rank`'s current incarnation; `PeerTimeout` if it has not started by the deadline."""


@runtime_checkable
class Resets(Protocol):
    """Generations of directed edges: how often a rank has reset its end of the edge with a peer on a
    stream (an abort), in this life or an earlier one.

    A reset tears the connection down with a TCP reset, but the peer learns of it only when the reset
    reaches it, and a retry may be quicker (the router hears of the failure and re-pairs the two at
    once). So the rank that aborts counts the reset here before its call returns, and the peer reads
    the count before the first message of a new exchange (`Fabric.refresh`): a count other than the
    one its connection was made under means that connection is dead, whatever the socket says yet.
    """

    def note_reset(self, rank: int, peer: int, stream: int) -> None:
        """`rank` has reset its end of the edge with `peer` on `stream`."""

    def generation(self, rank: int, peer: int, stream: int) -> int:
        """A number that changes whenever `rank` resets its end of that edge or restarts."""


def pair_tag(rendezvous: object, src: int, dst: int, deadline: Deadline) -> str:
    """The part of a set-up key naming the current lives of `src` and `dst`: "" when `rendezvous`
    has no incarnations, else "@<src incarnation>.<dst incarnation>"."""
    if not isinstance(rendezvous, Incarnations):
        return ""
    return f"@{rendezvous.incarnation_of(src, deadline)}.{rendezvous.incarnation_of(dst, deadline)}"


class DictRendezvous:
    """In-process rendezvous (all ranks share one object), with the edge generations of `Resets`."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._resets: dict[tuple[int, int, int], int] = {}
        self._cond = threading.Condition()

    def note_reset(self, rank: int, peer: int, stream: int) -> None:
        with self._cond:
            self._resets[rank, peer, stream] = self._resets.get((rank, peer, stream), 0) + 1

    def generation(self, rank: int, peer: int, stream: int) -> int:
        with self._cond:
            return self._resets.get((rank, peer, stream), 0)

    def publish(self, key: str, value: bytes) -> None:
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def lookup(self, key: str, deadline: Deadline) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._values, timeout=deadline.remaining()):
                raise PeerTimeout(f"rendezvous key {key!r} not published before the deadline")
            return self._values[key]


class FileRendezvous:
    """Rendezvous through files in a shared directory (written atomically by rename)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / key.replace("/", "__")

    def publish(self, key: str, value: bytes) -> None:
        path = self._path(key)
        temporary = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        temporary.write_bytes(value)
        temporary.replace(path)

    def lookup(self, key: str, deadline: Deadline) -> bytes:
        path = self._path(key)
        while True:
            if path.exists():
                return path.read_bytes()
            if deadline.expired():
                raise PeerTimeout(f"rendezvous key {key!r} not published in {self.directory}")
            time.sleep(_POLL_S)
