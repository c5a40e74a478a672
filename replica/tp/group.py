"""`TpGroup`: the ranks of one tensor-parallel replica, joined over `torch.distributed`.

```
 rank 0 (leader, serves gRPC) ── TCPStore on HOST:PORT (hosted by rank 0) ──► ranks 1..N-1 (workers)
   init_process_group(gloo on CPU | nccl on CUDA, timeout=T): every collective fails after T
   commands: store key "tp/cmd/<n>" = pickled Command, read by each worker in order (CommandChannel)
```
Commands go through the store, not a collective, because a worker waits for the next step for as long
as the replica is idle (no deadline is right for that wait), while the collectives inside a step must
have one. A worker polls for its next command and leaves when the store is gone (the leader died).
A group whose collective failed, or whose worker process ended, is broken for good (`TpGroupFailed`):
`TpGroup.fail` records why once and calls the `when_broken` callbacks (the replica server's: rank 0
then leaves, so its supervisor restarts the whole group).
"""

from __future__ import annotations

import datetime
import enum
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from replica.errors import ReplicaError, Status
from replica.model.layout import Shard

DEFAULT_TIMEOUT_S = 30.0
# an idle worker wakes once a minute (each wake logs a c10d timeout warning); a set key wakes it at once
_POLL = datetime.timedelta(seconds=60)


class TpGroupFailed(ReplicaError):
    """A rank of the tensor-parallel group died or missed a collective's deadline (UNAVAILABLE).

    The fault is this replica's own (no peer cause): its group cannot run a step again."""

    status = Status.UNAVAILABLE


class Op(enum.Enum):
    """What the leader asks the workers to do."""

    FORWARD = "forward"  # one forward of the given sequences
    MOVE_KV = "move_kv"  # this rank's part of a KV migration (`kvmove.ShardJob`), on a thread
    WEIGHTS = "weights"  # this rank's part of a weight operation (`weights.WeightJob`), on a thread
    STOP = "stop"  # leave the loop


@dataclass(frozen=True)
class Command:
    """One step's inputs, broadcast by the leader: an `Op` and its plain-Python argument."""

    op: Op
    arg: Any = None


def host_store(host: str, world: int, timeout_s: float) -> dist.TCPStore:
    """The leader's store on a port the OS picks (`store.port`): no race for a free port."""
    return dist.TCPStore(host, 0, world, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(host: str, port: int, world: int, timeout_s: float) -> dist.TCPStore:
    """A worker's client of the leader's store (waits up to `timeout_s` for it)."""
    return dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def backend_for(device: torch.device) -> str:
    """gloo on the CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


class CommandChannel:
    """Commands in order over the group's store: the leader sets key n, each worker reads keys in turn
    and the last of the `readers` to read one deletes it (no step leaves anything behind)."""

    def __init__(self, store: dist.Store, readers: int) -> None:
        self.store, self.readers = store, readers
        self.count = 0  # commands published (leader) or read (worker) so far
        self._lock = threading.Lock()  # steps (engine thread) and migrations (call threads) publish

    def publish(self, command: Command) -> None:
        """Leader: make `command` the next one every worker reads."""
        with self._lock:
            self.store.set(f"tp/cmd/{self.count}", pickle.dumps(command))  # type: ignore[arg-type]
            self.count += 1

    def receive(self) -> Command:
        """Worker: the next command, waiting as long as the leader is alive (RuntimeError once it is gone)."""
        key = f"tp/cmd/{self.count}"
        while True:
            try:
                self.store.wait([key], _POLL)
                break
            except dist.DistStoreError as error:  # this poll's timeout (an idle replica), else a failure
                if "timeout" not in str(error).lower():
                    raise
        command = pickle.loads(self.store.get(key))
        if self.store.add(f"tp/read/{self.count}", 1) == self.readers:
            self.store.delete_key(key)
            self.store.delete_key(f"tp/read/{self.count}")
        self.count += 1
        assert isinstance(command, Command)
        return command


class TpGroup:
    """This process's membership of the group (rank `shard.rank` of `shard.world`)."""

    def __init__(self, shard: Shard, store: dist.TCPStore, device: torch.device,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.shard, self.store = shard, store
        self.backend = backend_for(device)
        dist.init_process_group(self.backend, store=store, rank=shard.rank, world_size=shard.world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.commands = CommandChannel(store, shard.world - 1)
        self.failed: str | None = None  # why the group broke (None while it works)
        self._broken: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def fail(self, reason: str) -> None:
        """Mark the group broken for `reason` (the first reason stays); call the `when_broken` callbacks."""
        with self._lock:
            if self.failed is not None:
                return
            self.failed = reason
            callbacks = list(self._broken)
        for callback in callbacks:
            callback(reason)

    def when_broken(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once the group breaks (at once if it already has)."""
        with self._lock:
            failed = self.failed
            if failed is None:
                self._broken.append(callback)
        if failed is not None:
            callback(failed)

    @property
    def is_leader(self) -> bool:
        """Rank 0 drives the group."""
        return self.shard.rank == 0

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
