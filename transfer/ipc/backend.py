"""The device layer behind a small protocol: all the cuda-ipc fabric needs from a GPU.

The fabric never touches device memory itself. It asks its `IpcBackend` which registered objects
are device memory, exports each such buffer once as an IPC handle (bytes a peer process on the
same host can open), opens a peer's handle, marks the caller's (producer) stream, and queues copies
on a fabric stream after such a mark, getting back a `Completion` (an event) to poll.

Implementations: `cuda.py` (torch; imported only when a CUDA tensor is registered) and `shm.py`
(host memory shared between processes, copies by a worker thread: the CPU suite's double, which
also moves host memory between processes on one host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from transfer.buffers import device_type
from transfer.ipc.logic import Piece


class Completion(Protocol):
    """Queued copies (a CUDA event recorded after them)."""

    def done(self) -> bool:
        """Whether the copies have finished (never blocks)."""
        ...


class DeviceBuffer(Protocol):
    """One registered device buffer (this process's memory)."""

    @property
    def nbytes(self) -> int: ...


class RemoteBuffer(Protocol):
    """A peer's device buffer, opened from its IPC handle."""

    @property
    def nbytes(self) -> int: ...


class IpcBackend(Protocol):
    """Export, open, mark and copy."""

    def memory_of(self, obj: object) -> DeviceBuffer | None:
        """`obj` as device memory, or None for host memory (the control fabric moves that)."""
        ...

    def export(self, buffer: DeviceBuffer) -> bytes:
        """The IPC handle of `buffer` (called once per registration)."""
        ...

    def release(self, buffer: DeviceBuffer) -> None:
        """`buffer`'s registration ended (peers that opened it keep their mapping)."""
        ...

    def open(self, handle: bytes) -> RemoteBuffer:
        """A peer's buffer from its handle (the fabric calls this once per peer and registration)."""
        ...

    def producer_mark(self, buffer: DeviceBuffer) -> object:
        """A mark (event) on the calling thread's current stream of `buffer`'s device: copies given it
        as `after` start only once every kernel queued there before this call has finished."""
        ...

    def copy(self, src: DeviceBuffer, dst: RemoteBuffer, pieces: Sequence[Piece],
             after: object) -> Completion:
        """Queue, on the fabric stream of `src`'s device after mark `after`, the copies `pieces`
        (from `src` into `dst`), and record the event returned."""
        ...

    def close(self) -> None:
        """Wait for queued copies and release streams and threads."""
        ...


class TorchIpcBackend:
    """CUDA tensors are device memory (torch's IPC, `cuda.py`); anything else is host memory."""

    def __init__(self) -> None:
        self._cuda: IpcBackend | None = None

    def _backend(self) -> IpcBackend:
        if self._cuda is None:
            from transfer.ipc.cuda import CudaIpcBackend  # imports torch: only once a CUDA tensor comes

            self._cuda = CudaIpcBackend()
        return self._cuda

    def memory_of(self, obj: object) -> DeviceBuffer | None:
        return self._backend().memory_of(obj) if device_type(obj) == "cuda" else None

    def export(self, buffer: DeviceBuffer) -> bytes:
        return self._backend().export(buffer)

    def release(self, buffer: DeviceBuffer) -> None:
        self._backend().release(buffer)

    def open(self, handle: bytes) -> RemoteBuffer:
        return self._backend().open(handle)

    def producer_mark(self, buffer: DeviceBuffer) -> object:
        return self._backend().producer_mark(buffer)

    def copy(self, src: DeviceBuffer, dst: RemoteBuffer, pieces: Sequence[Piece],
             after: object) -> Completion:
        return self._backend().copy(src, dst, pieces, after)

    def close(self) -> None:
        if self._cuda is not None:
            self._cuda.close()
