"""The real NCCL backend: cupy's bindings. Importing this module imports cupy."""

from __future__ import annotations

from typing import Any

from transfer.nccl.logic import NcclComm, cuda_pointer, decode_unique_id, encode_unique_id


class CupyBackend:
    """`NcclBackend` over `cupy.cuda.nccl`, on CUDA device `device`."""

    def __init__(self, device: int = 0) -> None:
        import cupy
        from cupy.cuda import nccl

        self._cupy, self._nccl, self._device = cupy, nccl, device
        self.activate()

    def activate(self) -> None:
        self._cupy.cuda.Device(self._device).use()

    def unique_id(self) -> bytes:
        return encode_unique_id(self._nccl.get_unique_id())

    def communicator(self, world: int, uid: bytes, rank: int) -> NcclComm:
        return _CupyComm(self._nccl, self._nccl.NcclCommunicator(world, decode_unique_id(uid), rank))

    def group_start(self) -> None:
        self._nccl.groupStart()

    def group_end(self) -> None:
        self._nccl.groupEnd()

    def new_stream(self) -> Any:
        return self._cupy.cuda.Stream(non_blocking=True)

    def record(self, stream: Any) -> Any:
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def pointer(self, obj: object) -> tuple[int, int]:
        return cuda_pointer(obj)

    def scratch(self, nbytes: int) -> object:
        return self._cupy.zeros(nbytes, dtype=self._cupy.uint8)

    def status_of(self, exc: BaseException) -> int | None:
        return getattr(exc, "status", None) if isinstance(exc, self._nccl.NcclError) else None


class _CupyComm:
    def __init__(self, nccl: Any, comm: Any) -> None:
        self._nccl, self._comm = nccl, comm

    def send(self, ptr: int, nbytes: int, peer: int, stream: Any) -> None:
        self._comm.send(ptr, nbytes, self._nccl.NCCL_UINT8, peer, stream.ptr)

    def recv(self, ptr: int, nbytes: int, peer: int, stream: Any) -> None:
        self._comm.recv(ptr, nbytes, self._nccl.NCCL_UINT8, peer, stream.ptr)

    def abort(self) -> None:
        self._comm.abort()

    def destroy(self) -> None:
        self._comm.destroy()
