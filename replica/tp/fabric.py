"""A worker rank's own fabric endpoint, over the replica's `--fabric` (the same choice as rank 0's).

```
 rank 0: --fabric F ─► worker argv "--fabric F" ─► choose_worker_fabric(F, table, R + r, its buffers)
   tcp (host buffers) │ tcp staged through host memory (CUDA buffers) │ nccl / rdma / cuda-ipc: device
   buffers moved by the device fabric itself (control on tcp), each rank registering its own buffers
```
`auto` resolves per rank exactly as `replica.cluster.resolve_fabric` does for a replica (a group's
ranks share a node and a device type, so every rank of a group resolves it alike). nccl and rdma
meet their peers through the rank table's store, as a one-rank replica does; tcp (or a device
fabric's control tcp) counts its resets there too (`resets`: a retry right after a reset connects afresh).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from replica.cluster import (
    DEVICE_FABRICS,
    ReplicaCluster,
    device_fabric_options,
    needs_staging,
    resolve_fabric,
    store_rendezvous,
)
from transfer.buffers import device_type
from transfer.fabric import FabricKind
from transfer.ranktable import RankTable
from transfer.staged.device import TorchDevices


@dataclass(frozen=True)
class WorkerFabric:
    """What a worker rank opens: the fabric kind, and whether tcp stages its device buffers."""

    kind: FabricKind
    staged: bool


def choose_worker_fabric(choice: str, table: RankTable, rank: int, devices: Iterable[str]) -> WorkerFabric:
    """The fabric of global rank `rank` (a worker) for `--fabric choice`, given where its KV cache and
    weights live (`transfer.buffers.device_type` names); ValueError for a choice no rank can open."""
    devices = tuple(devices)
    kind = resolve_fabric(choice, table, rank, devices)
    if kind is FabricKind.FAKE:
        raise ValueError("--fabric fake is the simulated replicas': a tp group needs a real fabric")
    return WorkerFabric(kind, needs_staging(kind, devices))


def open_worker_cluster(choice: str, table: RankTable, rank: int, kv_tensor: Any,
                        weights: Any) -> ReplicaCluster:
    """Open worker `rank`'s fabric on its table entry's transfer address (`FabricUnavailable` names
    what is missing: a library, a device, a store for nccl / rdma)."""
    chosen = choose_worker_fabric(choice, table, rank, (device_type(kv_tensor), device_type(weights)))
    store = store_rendezvous(table, rank)
    options: dict[str, Any] = {"resets": store} if store is not None else {}
    if chosen.kind in DEVICE_FABRICS:
        options = device_fabric_options(chosen.kind, table, rank, kv_tensor, options, store)
    staging = TorchDevices() if chosen.staged else None
    return ReplicaCluster.start(chosen.kind, table, rank, "", staging, **options)
