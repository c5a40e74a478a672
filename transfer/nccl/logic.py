"""The NCCL fabric's hardware-free logic: ids, chunking, world ranks, error mapping, warm-up peers.

Also the `NcclBackend` protocol: the narrow slice of cupy the fabric uses, so tests can run the
whole fabric against a test double.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from transfer.core import Rank
from transfer.errors import PeerGone, PeerTimeout, TransferError
from transfer.ranktable import RankTable

MAX_COUNT = (1 << 31) - 1  # NCCL counts are C ints
UNIQUE_ID_BYTES = 128

# ncclResult_t values that mean the other side (or the network to it) is gone
_REMOTE_ERRORS = {2: "system error (peer or network down)", 6: "remote error (peer failed)"}
_USAGE_ERRORS = {4: "invalid argument", 5: "invalid usage"}


class NcclComm(Protocol):
    """One NCCL communicator."""

    def send(self, ptr: int, nbytes: int, peer: int, stream: Any) -> None: ...
    def recv(self, ptr: int, nbytes: int, peer: int, stream: Any) -> None: ...
    def abort(self) -> None: ...
    def destroy(self) -> None: ...


class DoneEvent(Protocol):
    """A recorded CUDA event."""

    @property
    def done(self) -> bool: ...


class NcclBackend(Protocol):
    """What the fabric needs from cupy (or from a test double)."""

    def activate(self) -> None: ...  # make this backend's device current in the calling thread
    def unique_id(self) -> bytes: ...
    def communicator(self, world: int, uid: bytes, rank: int) -> NcclComm: ...
    def group_start(self) -> None: ...
    def group_end(self) -> None: ...
    def new_stream(self) -> Any: ...
    def record(self, stream: Any) -> DoneEvent: ...
    def pointer(self, obj: object) -> tuple[int, int]: ...
    def scratch(self, nbytes: int) -> object: ...
    def status_of(self, exc: BaseException) -> int | None: ...


@contextlib.contextmanager
def group(backend: NcclBackend) -> Iterator[None]:
    """`ncclGroupStart` … `ncclGroupEnd` (ends the group even if an op raised)."""
    backend.group_start()
    try:
        yield
    finally:
        backend.group_end()


def encode_unique_id(uid: bytes | tuple[int, ...] | list[int]) -> bytes:
    """cupy returns the id as a tuple of signed chars; store it as 128 raw bytes."""
    raw = bytes(uid) if isinstance(uid, bytes) else bytes(c & 0xFF for c in uid)
    if len(raw) != UNIQUE_ID_BYTES:
        raise TransferError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


def decode_unique_id(raw: bytes) -> tuple[int, ...]:
    """The tuple of signed chars cupy's `NcclCommunicator` expects."""
    return tuple(b - 256 if b > 127 else b for b in encode_unique_id(raw))


def edge_key(stream: int, src: int, dst: int, generation: int) -> str:
    """Rendezvous key of the unique id of the `src` → `dst` communicator of `stream`."""
    return f"nccl/uid/{stream}/{src}-{dst}/{generation}"


def layout_key(rank: int) -> str:
    """Rendezvous key of `rank`'s layout descriptors (JSON: stream → descriptor)."""
    return f"nccl/layouts/{rank}"


def device_pieces(
    base: int, segments: list[tuple[int, int]], limit: int = MAX_COUNT
) -> list[tuple[int, int]]:
    """(device pointer, nbytes) calls covering `segments` of the buffer at `base`, each ≤ `limit`."""
    pieces = []
    for offset, length in segments:
        for start in range(0, length, limit):
            pieces.append((base + offset + start, min(limit, length - start)))
    return pieces


def warmup_peers(table: RankTable, rank: int) -> list[Rank]:
    """Peers on this rank's node: their NCCL connections are created at start, not on first use."""
    return [r for r in table.ranks if r != rank and table.same_node(r, rank)]


def map_nccl_error(status: int | None, what: str) -> TransferError:
    """The transfer error for an NCCL failure status."""
    if status in _REMOTE_ERRORS:
        return PeerGone(f"{what}: NCCL {_REMOTE_ERRORS[status]}")
    if status in _USAGE_ERRORS:
        return TransferError(f"{what}: NCCL {_USAGE_ERRORS[status]}")
    if status == 7:
        return PeerTimeout(f"{what}: NCCL operation still in progress")
    return TransferError(f"{what}: NCCL failure (status {status})")


def cuda_pointer(obj: object) -> tuple[int, int]:
    """(device pointer, nbytes) of a cupy array or CUDA torch tensor (`__cuda_array_interface__`)."""
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is None:
        raise TypeError(f"a {type(obj).__name__} is not device memory (no __cuda_array_interface__)")
    if interface.get("strides") not in (None, ()):
        raise ValueError("only contiguous device buffers can be registered")
    count = 1
    for dim in interface["shape"]:
        count *= int(dim)
    itemsize = int(interface["typestr"][2:])
    return int(interface["data"][0]), count * itemsize
