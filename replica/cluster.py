"""Replica ↔ transfer wiring: the rank table, this rank's fabric and the buffers it registers.

```
 --cluster RANKS_FILE ─► RankTable ─┐                         ┌─ "kv"      = PagedKVCache.tensor (bytes)
 (or a one-rank table of this       ├─► create_fabric(kind) ─►│  "weights" = the flat weight buffer
  process when unset)  --rank R ────┘                         └─ layout descriptor on the KV stream
```

`ReplicaCluster` is created by `serve()` at start (after the model is loaded) and closed at stop.
A replica whose KV cache or weights are CUDA tensors on the tcp fabric gets tcp wrapped in the staging
fabric (`transfer/staged`: device bytes through pinned host slots), so migrations and weight transfers
work between GPU replicas without RDMA; buffers no fabric here can move (a meta tensor) are left out
and the calls that need them fail FAILED_PRECONDITION with the reason (`require_movable`).
On `--fabric cuda-ipc` (every rank on one host) device buffers go device to device through CUDA IPC
handles and host buffers over the fabric's own tcp control; nccl and rdma are a `SplitFabric`.
The KV stream's handshake carries `KvLayout.descriptor()`: two replicas whose block size, KV heads,
head dim, dtype, layer count or TP degree differ cannot even connect on it, so no KV byte moves
between incompatible caches (the fabric reports `LayoutMismatch` → FAILED_PRECONDITION on both sides).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from replica.config import EngineKind
from replica.errors import FailedPrecondition
from transfer.buffers import device_type
from transfer.composite import SplitFabric
from transfer.core import Rank, Stream
from transfer.errors import FabricUnavailable
from transfer.fabric import Fabric, FabricKind, choose_fabric, create_fabric, importable
from transfer.ports import free_ports
from transfer.ranktable import RankEntry, RankTable, load_rank_table
from transfer.rendezvous import DictRendezvous, Rendezvous
from transfer.staged import StagedFabric
from transfer.staged.device import Devices, TorchDevices
from transfer.store import StoreRendezvous, connect_store

log = logging.getLogger(__name__)

KV_BUFFER = "kv"
"""Name of the KV cache tensor in the fabric's buffer registry."""

WEIGHT_BUFFER = "weights"
"""Name of the flat weight buffer in the fabric's buffer registry."""


@dataclass(frozen=True)
class KvLayout:
    """What must match between two KV caches for pages to move byte for byte."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_layers: int
    tp_size: int = 1

    def descriptor(self) -> str:
        """The string compared at the KV stream's handshake (stable key order)."""
        return "kv:" + json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def local_table(rank: int, host: str, grpc_port: int) -> RankTable:
    """The one-rank table of a replica started without `--cluster` (no peers; ServiceDiscovery works)."""
    entry = RankEntry(rank=Rank(rank), host=host, node="n0", device="cpu",
                      transfer_address=f"{host}:{free_ports(1, host)[0]}", grpc_port=grpc_port)
    return RankTable((entry,))


def load_table(cluster: Path | None, rank: int, host: str, grpc_port: int) -> RankTable:
    """The rank table from `--cluster`, or this process alone; `rank` must be in it."""
    table = load_rank_table(cluster) if cluster is not None else local_table(rank, host, grpc_port)
    if rank not in table:
        raise ValueError(f"--rank {rank} is not in the rank table {cluster}")
    return table


class ReplicaCluster:
    """This replica's view of the cluster: the table, its fabric and its registered buffers."""

    def __init__(self, table: RankTable, rank: int, fabric: Fabric, grpc_address: str,
                 kind: str = "") -> None:
        self.kind = kind  # the --fabric it resolved to ("tcp", "cuda-ipc", ...): Info reports it
        self.table = table
        self.rank = rank
        self.fabric = fabric
        self.grpc_address = grpc_address
        self._lock = threading.Lock()
        self._kv_tensor: object | None = None
        # buffer name -> why this fabric cannot move it (memory it cannot reach, e.g. a meta tensor)
        self.unmovable: dict[str, str] = {}

    @classmethod
    def start(
        cls, kind: str, table: RankTable, rank: int, grpc_address: str, staging: Devices | None = None,
        **fabric_options: Any,
    ) -> ReplicaCluster:
        """Create the fabric of `rank` (it starts listening at once); with `staging`, wrapped in the
        staging fabric, which takes the device buffers `staging` recognises (see `needs_staging`)."""
        fabric = open_fabric(kind, table, rank, **fabric_options)
        if staging is not None:
            fabric = StagedFabric(fabric, staging)
        log.info("fabric %s%s of rank %d on %s", kind, " (device buffers staged through host memory)"
                 if staging is not None else "", rank, table[rank].transfer_address)
        return cls(table, rank, fabric, grpc_address, FabricKind(kind).value)

    # buffers ------------------------------------------------------------------------------
    def register_kv(self, tensor: object, layout: KvLayout) -> None:
        """Register the KV cache tensor and announce its layout on the KV stream."""
        with self._lock:
            self._register(KV_BUFFER, tensor)
            self._kv_tensor = tensor
        self.fabric.set_layout(Stream.KV, layout.descriptor())

    def ensure_kv(self, tensor: object) -> None:
        """Re-register the KV tensor if the cache was replaced (Warmup resizes it); cheap otherwise.

        FailedPrecondition when this fabric cannot move the cache (device memory on tcp)."""
        with self._lock:
            if tensor is not self._kv_tensor:
                self._register(KV_BUFFER, tensor)
                self._kv_tensor = tensor
        self.require_movable(KV_BUFFER)

    def register_weights(self, buffer: object) -> int:
        """Register the flat weight buffer (parameters are views into it); returns its size in bytes
        (0 when this fabric cannot move it: see `require_movable`)."""
        return self._register(WEIGHT_BUFFER, buffer)

    def require_movable(self, name: str) -> None:
        """FailedPrecondition naming the reason when buffer `name` cannot go over this fabric."""
        if name in self.unmovable:
            raise FailedPrecondition(self.unmovable[name])

    def _register(self, name: str, buffer: object) -> int:
        """Register `buffer`; a device tensor the fabric refuses (a meta tensor; CUDA memory on a
        fabric without staging) is left out, and the calls that would move it fail with the reason,
        while the replica serves everything else."""
        device = device_type(buffer)
        try:
            size = self.fabric.register(name, buffer)
        except ValueError as exc:
            if device == "cpu":
                raise
            self.unmovable[name] = (
                f"the {name} buffer is in {device} memory, which the {type(self.fabric).__name__} cannot "
                f"move ({exc}); strategies that send no KV (recompute, colocated) still work"
            )
            log.warning("%s", self.unmovable[name])
            return 0
        self.unmovable.pop(name, None)
        return size

    # discovery ----------------------------------------------------------------------------
    def urls(self) -> list[str]:
        """gRPC URLs of this replica's TP group (TP degree 1: this process)."""
        return [self.grpc_address]

    def ranks_view_json(self) -> str:
        """The rank table as JSON, in the transfer layer's file format (what `--cluster` reads)."""
        return self.table.to_json()

    def close(self) -> None:
        """Close the fabric (fails pending transfers, joins its threads)."""
        self.fabric.close()


def kv_layout_of(cache: Any, tp_size: int = 1) -> KvLayout:
    """The `KvLayout` of a `PagedKVCache`."""
    return KvLayout(
        block_size=cache.block_size,
        num_kv_heads=cache.num_kv_heads,
        head_dim=cache.head_dim,
        dtype=str(cache.dtype).removeprefix("torch."),
        num_layers=cache.num_layers,
        tp_size=tp_size,
    )


def needs_staging(kind: str, devices: Iterable[str]) -> bool:
    """Whether a replica on fabric `kind` whose buffers live on `devices` ("cpu", "cuda", ... as
    `transfer.buffers.device_type` names them) needs the staging fabric: tcp moves host memory only."""
    return kind == FabricKind.TCP and "cuda" in set(devices)


def resolve_fabric(choice: str, table: RankTable, rank: int, devices: Iterable[str]) -> FabricKind:
    """The fabric `--fabric choice` means for this replica: `auto` is cuda-ipc when its buffers are
    CUDA memory and every rank of the table is on its node; across nodes nccl (rdma where this
    rank's table entry names an RDMA NIC and pyverbs imports) where the library imports; else tcp
    (staged for device buffers)."""
    if choice != "auto":
        return FabricKind(choice)
    across = any(not table.same_node(rank, other) for other in table.ranks)
    kind = choose_fabric("cuda" in set(devices), across, bool(table[rank].rdma_device), importable)
    log.info("--fabric auto: %s (buffers on %s, %s)", kind.value, "/".join(sorted(set(devices))),
             "ranks on several nodes" if across else "every rank on this node")
    return kind


DEVICE_FABRICS = (FabricKind.NCCL, FabricKind.RDMA, FabricKind.CUDA_IPC)
"""The fabrics that move device buffers themselves (control on tcp): `device_fabric_options` first."""


def device_fabric_options(kind: FabricKind, table: RankTable, rank: int, kv_tensor: Any,
                          options: dict[str, Any], store: StoreRendezvous | None = None) -> dict[str, Any]:
    """`open_fabric`'s options for nccl/rdma/cuda-ipc: the rendezvous (nccl/rdma: `store`, this
    rank's life in the rank table's store, made here when not given; none is needed without peers),
    the device or NIC, the device fabric's `backend` when `options` names one, and the rest of
    `options` for the control fabric (tcp). `FabricUnavailable` (one line) when this replica cannot
    use `kind`."""
    control = dict(options)
    bulk = {"backend": control.pop("backend")} if control.get("backend") is not None else {}
    _check_kv_memory(kind, kv_tensor, bulk.get("backend"))
    if kind is FabricKind.CUDA_IPC:
        _check_one_host(table, rank)
        return {**bulk, "control_options": control}
    device: dict[str, Any] = {"device": getattr(kv_tensor.device, "index", None) or 0}
    if kind is FabricKind.RDMA:
        device = {"device_name": table[rank].rdma_device}
    store = store or store_rendezvous(table, rank)
    return {"rendezvous": _rendezvous(kind, table, store), **device, **bulk, "control_options": control}


def _check_kv_memory(kind: FabricKind, kv_tensor: Any, backend: Any) -> None:
    """nccl and cuda-ipc move CUDA memory only (a given backend says what its device memory is)."""
    if kind not in (FabricKind.NCCL, FabricKind.CUDA_IPC):
        return
    on_device = backend.memory_of(kv_tensor) is not None if kind is FabricKind.CUDA_IPC and backend \
        else device_type(kv_tensor) == "cuda"
    if not on_device:
        where = device_type(kv_tensor)
        raise FabricUnavailable(f"fabric {kind.value} moves CUDA memory, but this replica's KV cache is in "
                                f"{where} memory: start it with --device cuda, or --fabric tcp")


def _check_one_host(table: RankTable, rank: int) -> None:
    """cuda-ipc opens peers' device memory: every rank must be on this rank's node."""
    away = sorted({table[r].node for r in table.ranks if not table.same_node(rank, r)})
    if away:
        raise FabricUnavailable(f"fabric cuda-ipc joins ranks on one host, but the rank table puts ranks on "
                                f"{table[rank].node} and {', '.join(away)}: use --fabric nccl, rdma or auto")


def store_rendezvous(table: RankTable, rank: int) -> StoreRendezvous | None:
    """This rank's new incarnation in the rank table's store (None when the table names none)."""
    if not table.store:
        return None
    store = StoreRendezvous(connect_store(table.store), rank)
    log.info("rendezvous store %s: rank %d, incarnation %d", table.store, rank, store.incarnation)
    return store


def _rendezvous(kind: FabricKind, table: RankTable, store: StoreRendezvous | None) -> Rendezvous:
    """The store; an in-process rendezvous without peers; else `FabricUnavailable`."""
    if store is not None:
        return store
    if len(table) == 1:
        return DictRendezvous()  # no peer to meet
    raise FabricUnavailable(f"fabric {kind.value} needs a rendezvous store, and the rank table names "
                            'none (top-level "store": "HOST:PORT"; pdcluster up and launch serve one)')


def open_fabric(kind: FabricKind | str, table: RankTable, rank: int, rendezvous: Rendezvous | None = None,
                control_options: dict[str, Any] | None = None, **options: Any) -> Fabric:
    """The replica's one fabric: tcp (or fake) as it is; nccl and rdma as a `SplitFabric`, control on
    tcp (`control_options`) and device buffers on the device fabric (`options`: device, backend);
    cuda-ipc on its own control fabric, that same tcp (it routes host buffers there itself, so no
    `SplitFabric`; `options`: backend)."""
    kind = FabricKind(kind)
    if kind not in DEVICE_FABRICS:
        return create_fabric(kind, table, rank, **options)
    control = create_fabric(FabricKind.TCP, table, rank, **(control_options or {}))
    try:
        if kind is FabricKind.CUDA_IPC:
            return create_fabric(kind, table, rank, control=control, **options)
        bulk = create_fabric(kind, table, rank, rendezvous=rendezvous, warmup_streams=(), **options) \
            if kind is FabricKind.NCCL else create_fabric(kind, table, rank, rendezvous=rendezvous, **options)
    except BaseException:
        control.close()
        raise
    return SplitFabric(control, bulk, kind.value)


def scaled_links(table: RankTable, scale: float) -> RankTable:
    """The table with every emulated link's rate times `scale` (a simulated replica moves its card's
    bytes times the byte scale, so its links are paced at the same scale: transfers take the time
    the full-size bytes would take on the full-rate links)."""
    return RankTable(tuple(dataclasses.replace(e, link_gbps=e.link_gbps * scale) for e in table.entries))


def build_cluster(
    config: Any, grpc_port: int, engine: Any, weights: Any, **fabric_options: Any
) -> ReplicaCluster:
    """What `serve()` does at start: table, fabric of `--fabric`, the engine's KV cache and the flat
    weight buffer `weights` (the parameter store's: the model's parameters are views into it)
    registered. A simulated replica paces the table's links at its byte scale (`scaled_links`);
    discovery still reports them as given. `fabric_options` go to the fabric (to the control tcp of
    a device fabric, except `backend`: the device fabric's, e.g. a double in tests)."""
    table = load_table(config.cluster, config.rank, config.host, grpc_port)
    paced = scaled_links(table, config.scale) if config.engine is EngineKind.SIMULATED else table
    cache = engine.runner.cache
    devices = (device_type(cache.tensor), device_type(weights))
    kind = resolve_fabric(config.fabric, table, config.rank, devices)
    store = store_rendezvous(table, config.rank)
    if store is not None and kind is not FabricKind.FAKE:
        fabric_options = {"resets": store, **fabric_options}  # tcp's, or the control tcp's of a device fabric
    if kind in DEVICE_FABRICS:
        fabric_options = device_fabric_options(kind, table, config.rank, cache.tensor, fabric_options, store)
    staged = needs_staging(kind, devices)
    cluster = ReplicaCluster.start(kind, paced, config.rank, f"{config.host}:{grpc_port}",
                                   TorchDevices() if staged else None, **fabric_options)
    cluster.table = table
    try:
        cluster.register_kv(cache.tensor, kv_layout_of(cache, getattr(config, "tp", 1)))
        cluster.register_weights(weights)
    except BaseException:
        cluster.close()
        raise
    return cluster
