"""Device memory behind a small interface: all the staging fabric needs from a GPU.

The fabric never touches device memory itself. It asks a `DeviceMemory` to copy segments into a
host slot (or out of one) asynchronously and gets a `Completion` back; `Devices` says which
registered objects are device memory and allocates the (pinned) host slots. The torch CUDA
implementation is `cuda.py`, imported only when a CUDA tensor is registered; the CPU tests use a
double whose copies are slow and asynchronous, so ordering bugs show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from transfer.buffers import device_type
from transfer.core import Segments


class Completion(Protocol):
    """An asynchronous device copy (a CUDA event recorded after it)."""

    def done(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        ...


@dataclass(frozen=True)
class HostSlot:
    """Host memory the inner fabric sends from / receives into: `view` aliases `owner`'s memory."""

    view: memoryview
    owner: Any  # what the device backend copies with (a pinned torch tensor on CUDA)


class DeviceMemory(Protocol):
    """One registered device buffer."""

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        ...

    def ready_after_producer(self) -> object:
        """A mark on the calling thread's current (producer) stream: a copy given it as `after`
        starts only once every kernel queued there before this call has finished."""
        ...

    def to_host(self, segments: Segments, slot: HostSlot, after: object) -> Completion:
        """Queue, after mark `after`, the copy of `segments` (gathered, in order) into the start of `slot`."""
        ...

    def from_host(self, slot: HostSlot, segments: Segments) -> Completion:
        """Queue the copy of the start of `slot` scattered into `segments`."""
        ...


class Devices(Protocol):
    """Which objects are device memory, and the host slots to stage them through."""

    def memory_of(self, obj: object) -> DeviceMemory | None:
        """`obj` as device memory, or None when it is host memory (the inner fabric's business)."""
        ...

    def host_slot(self, nbytes: int) -> HostSlot:
        """New host memory of `nbytes` bytes to stage through (pinned on CUDA)."""
        ...

    def close(self) -> None:
        """Release what the backend holds (streams, threads)."""
        ...


class TorchDevices:
    """CUDA tensors are device memory; anything else goes to the inner fabric as it is (which
    registers host memory and refuses, with the reason, what it cannot move: a meta tensor)."""

    def __init__(self) -> None:
        self._cuda: Devices | None = None

    def _backend(self) -> Devices:
        if self._cuda is None:
            from transfer.staged.cuda import CudaDevices  # imports torch: only once a CUDA tensor comes

            self._cuda = CudaDevices()
        return self._cuda

    def memory_of(self, obj: object) -> DeviceMemory | None:
        return self._backend().memory_of(obj) if device_type(obj) == "cuda" else None

    def host_slot(self, nbytes: int) -> HostSlot:
        return self._backend().host_slot(nbytes)

    def close(self) -> None:
        if self._cuda is not None:
            self._cuda.close()
