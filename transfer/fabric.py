"""The fabric interface every backend implements, and the factory that picks one.

A fabric is created once per process from the rank table and this process's rank. It registers
buffers by name and posts sends/receives of a list of (offset, length) segments of one buffer as ONE
message (gather on the sender, scatter on the receiver; the two lists may differ, the totals must
match). Messages of one (peer, stream) pair are matched in posting order. Every call is thread-safe.
"""

from __future__ import annotations

import abc
import enum
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from transfer.core import Deadline, Handle, Rank, Segments
from transfer.errors import FabricUnavailable, TransferError
from transfer.ranktable import RankTable


class FabricKind(enum.StrEnum):
    """The available fabrics."""

    TCP = "tcp"
    FAKE = "fake"
    NCCL = "nccl"
    RDMA = "rdma"
    CUDA_IPC = "cuda-ipc"


FABRIC_CHOICES = ("tcp", "cuda-ipc", "nccl", "rdma", "auto")
"""What `--fabric` accepts on `pdcluster replica`, `up` and `launch` (and the cluster file)."""


def needs_store(choice: str) -> bool:
    """Whether replicas on `--fabric choice` may need the rendezvous store (nccl and rdma meet there;
    `auto` may pick them). tcp and cuda-ipc do not: cuda-ipc's handles travel on its tcp control."""
    return choice in (FabricKind.NCCL, FabricKind.RDMA, "auto")


class Fabric(abc.ABC):
    """Moves segments of registered buffers between this rank and its peers."""

    def __init__(self, table: RankTable, rank: int) -> None:
        if rank not in table:
            raise ValueError(f"rank {rank} is not in the rank table")
        self.table = table
        self.rank = Rank(rank)

    @abc.abstractmethod
    def register(self, name: str, obj: object) -> int:
        """Register buffer `obj` under `name` (replacing any previous one); returns its size."""

    @abc.abstractmethod
    def unregister(self, name: str) -> None:
        """Forget buffer `name`."""

    @abc.abstractmethod
    def set_layout(self, stream: int, descriptor: str) -> None:
        """Set the layout descriptor checked at the handshake of every connection on `stream`."""

    @abc.abstractmethod
    def send(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        """Post one message made of `segments` of buffer `name` to `peer` on `stream`."""

    @abc.abstractmethod
    def recv(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        """Post a receive of one message from `peer` on `stream` into `segments` of buffer `name`."""

    @abc.abstractmethod
    def connect(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        """Establish (or reuse) the outgoing connection to `peer` on `stream` now, handshake included."""

    @abc.abstractmethod
    def abort(self, peer: int, stream: int, reason: str) -> None:
        """Fail everything pending with `peer` on `stream` (both directions) and drop the connections.

        The peer sees the loss (its pending operations fail with `PeerGone`); the next operation
        connects afresh, so a retry starts from a clean, aligned state.
        """

    def warm(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        """Set up what the first message with `peer` on `stream` would (both directions where the
        fabric pairs ranks), moving no message: `connect` here; NCCL creates both communicators of
        the pair, so the peer must warm towards this rank at the same time (`ConnectPeers` on both
        ends does)."""
        return self.connect(peer, stream, deadline)

    def refresh(self, peer: int, stream: int) -> None:
        """Drop the idle outgoing connection to `peer` on `stream` if the peer has closed or reset it.

        A peer that aborted (or restarted) resets the connection, and a sender learns that only on
        its next write, which then fails. Call this before the first message of an exchange that no
        earlier failure can concern (a new migration) so that message connects afresh instead. A
        live or busy connection is kept; fabrics without such connections do nothing.
        """
        del peer, stream

    def withdraw(self, peer: int, stream: int, handle: Handle, error: TransferError) -> bool:
        """Take back a receive posted by `recv` that no message has started to fill.

        On success the receive leaves the queue as if it had never been posted (the next message
        from `peer` on `stream` goes to the next receive), `handle` fails with `error`, the
        connection stays up and True is returned. False when the receive is being filled, is done,
        or this fabric cannot take receives back: the caller then aborts, as before.
        """
        del peer, stream, handle, error
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Fail pending operations, close every socket and join every thread."""

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create_fabric(kind: FabricKind | str, table: RankTable, rank: int, **options: Any) -> Fabric:
    """Create the fabric `kind` for `rank`; the backend module is imported only when chosen.

    Options go to the backend's constructor: `inter_node_gbps` / `intra_node_gbps` for `tcp`,
    `network` (a `FakeNetwork`) for `fake`, `rendezvous` (and `device`, `backend`) for `nccl`,
    `rendezvous` (and `device_name`, `backend`) for `rdma`, `backend` and `control` (the fabric for
    control and host buffers; default tcp) for `cuda-ipc`. Unknown options raise `TypeError`; a
    device fabric whose library, device or NIC is missing raises `FabricUnavailable` (one line).
    """
    kind = FabricKind(kind)
    if kind is FabricKind.TCP:
        from transfer.tcp.fabric import TcpFabric

        return TcpFabric(table, rank, **options)
    if kind is FabricKind.FAKE:
        from transfer.fake import FakeFabric

        return FakeFabric(table, rank, **options)
    if kind is FabricKind.NCCL:
        from transfer.nccl.fabric import NcclFabric

        device = options.pop("device", 0)
        if options.get("backend") is None:
            options["backend"] = _device_backend(kind, "transfer.nccl.backend", "CupyBackend", device)
        return NcclFabric(table, rank, device=device, **options)
    if kind is FabricKind.CUDA_IPC:
        from transfer.ipc.fabric import CudaIpcFabric

        if options.get("backend") is None:
            require_cuda(kind)  # TorchIpcBackend (the default) opens torch's CUDA IPC lazily: check now
        return CudaIpcFabric(table, rank, **options)
    from transfer.rdma.fabric import RdmaFabric

    if options.get("backend") is None:
        options["backend"] = _device_backend(kind, "transfer.rdma.verbs", "PyverbsBackend",
                                             options.get("device_name", ""))
    return RdmaFabric(table, rank, **options)


def importable(module: str) -> bool:
    """Whether `module` can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def choose_fabric(on_cuda: bool, across_nodes: bool, rdma_nic: bool,
                  importable: Callable[[str], bool] = importable) -> FabricKind:
    """What `--fabric auto` picks: with CUDA buffers and every rank on this node, cuda-ipc (torch is
    there: the buffers are its tensors); across nodes, rdma where this rank has an RDMA NIC and
    pyverbs, else nccl where cupy is; everything else tcp (device buffers staged)."""
    if on_cuda and not across_nodes:
        return FabricKind.CUDA_IPC
    if on_cuda:
        if rdma_nic and importable("pyverbs"):
            return FabricKind.RDMA
        if importable("cupy"):
            return FabricKind.NCCL
    return FabricKind.TCP


_NEEDS = {FabricKind.NCCL: "cupy with NCCL and a CUDA device", FabricKind.RDMA: "pyverbs and an RDMA NIC",
          FabricKind.CUDA_IPC: "torch with a CUDA device"}


def require_cuda(kind: FabricKind) -> None:
    """`FabricUnavailable` (one line) unless torch imports here and sees a CUDA device."""
    try:
        import torch
    except Exception as exc:  # not installed, or a broken install: say which
        raise _unavailable(kind, exc) from exc
    if not torch.cuda.is_available():
        raise FabricUnavailable(f"fabric {kind.value} cannot start: it needs {_NEEDS[kind]} "
                                f"(torch {torch.__version__} sees none)")


def _unavailable(kind: FabricKind, exc: BaseException) -> FabricUnavailable:
    first = (str(exc).strip().splitlines() or [""])[0]
    return FabricUnavailable(f"fabric {kind.value} cannot start: it needs {_NEEDS[kind]} "
                             f"({type(exc).__name__}: {first})")


def _device_backend(kind: FabricKind, module: str, name: str, where: object) -> Any:
    """The device library's backend, or `FabricUnavailable` saying what is missing."""
    try:
        return getattr(importlib.import_module(module), name)(where)
    except Exception as exc:  # ImportError, no CUDA device, no RDMA device: say which, in one line
        raise _unavailable(kind, exc) from exc
