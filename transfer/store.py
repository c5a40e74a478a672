"""`StoreRendezvous`: the rendezvous over a key-value store every rank reaches
(`torch.distributed.TCPStore`), with incarnations.

```
 pdcluster up / launch ── serve_store() ─► TCPStore (outlives every replica: a restart loses nothing)
                                              ▲
 replica rank R, life k ── StoreRendezvous ───┤  "incarnation/R"  counter: k = add(+1) at start
                                              │  "rdv/<key>"       published values (NCCL ids, QP info)
 fabric: key of edge A→B carries (inc A, inc B), read with `incarnation_of` (see `pair_tag`)
 tcp:    "reset/A/B/s"  counter: A reset its end of the edge with B on stream s (`Resets`)
```
Each start of a rank bumps its counter, so a restarted replica's NCCL unique ids and queue-pair data
live under keys no earlier life used: its peers, when they next connect, read its new incarnation and
meet it there, never the ids of a life that is gone. Every wait has a deadline: a lookup polls the
store (one client, shared by every thread under a lock, never blocked inside the store) until the key
is there or the deadline passes (`PeerTimeout`). torch is imported only when a store is created.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Protocol

from transfer.core import Deadline
from transfer.errors import PeerTimeout, TransferError

_POLL_S = 0.01
_PREFIX = "pdcluster/"


class StoreUnreachable(TransferError):
    """The rendezvous store cannot be reached (wrong address, or the process serving it is gone)."""


class KeyValueStore(Protocol):
    """The slice of `torch.distributed.Store` the rendezvous uses."""

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT"; `ValueError` naming the problem otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rendezvous store address {address!r} is not HOST:PORT")
    return host, int(port)


def serve_store(host: str = "127.0.0.1", port: int = 0) -> tuple[Any, str]:
    """Serve a TCPStore on `host:port` (0: a free port) in this process; (store, its "HOST:PORT").

    The store lives as long as the returned object: keep it in a process that outlives the replicas."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=30))
    return store, f"{host}:{store.port}"


def connect_store(address: str, timeout_s: float = 30.0) -> Any:
    """A client of the TCPStore at `address`; `StoreUnreachable` when none answers within `timeout_s`."""
    host, port = parse_address(address)
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistNetworkError / DistStoreError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreUnreachable(f"no rendezvous store answers at {address}: {first}") from exc


class StoreRendezvous:
    """`Rendezvous` (and `Incarnations`) over `store`; with `rank`, this process joins as a new
    incarnation of that rank (`self.incarnation`, 1 for its first life)."""

    def __init__(self, store: KeyValueStore, rank: int | None = None, prefix: str = _PREFIX) -> None:
        self._store, self._prefix = store, prefix
        self._lock = threading.Lock()  # one client socket: one request at a time
        self.incarnation = 0
        if rank is not None:
            with self._lock:
                self.incarnation = int(store.add(self._counter(rank), 1))

    def _counter(self, rank: int) -> str:
        return f"{self._prefix}incarnation/{rank}"

    def publish(self, key: str, value: bytes) -> None:
        with self._lock:
            self._store.set(f"{self._prefix}rdv/{key}", bytes(value))

    def lookup(self, key: str, deadline: Deadline) -> bytes:
        full = f"{self._prefix}rdv/{key}"
        while True:
            with self._lock:
                if self._store.check([full]):
                    return bytes(self._store.get(full))
            if deadline.expired():
                raise PeerTimeout(f"rendezvous key {key!r} not published before the deadline")
            time.sleep(min(_POLL_S, deadline.remaining()))

    def note_reset(self, rank: int, peer: int, stream: int) -> None:
        with self._lock:
            self._store.add(self._reset_key(rank, peer, stream), 1)

    def generation(self, rank: int, peer: int, stream: int) -> int:
        """`rank`'s resets of the edge and its incarnation, in one number (resets in the low 32 bits)."""
        with self._lock:
            resets = int(self._store.add(self._reset_key(rank, peer, stream), 0))
            life = int(self._store.add(self._counter(rank), 0))
        return (life << 32) | (resets & 0xFFFFFFFF)

    def _reset_key(self, rank: int, peer: int, stream: int) -> str:
        return f"{self._prefix}reset/{rank}/{peer}/{stream}"

    def incarnation_of(self, rank: int, deadline: Deadline) -> int:
        """The current incarnation of `rank` (its latest start); waits for its first start."""
        while True:
            with self._lock:
                current = int(self._store.add(self._counter(rank), 0))  # reads without blocking
            if current > 0:
                return current
            if deadline.expired():
                raise PeerTimeout(f"rank {rank} has not joined the rendezvous store")
            time.sleep(min(_POLL_S, deadline.remaining()))
