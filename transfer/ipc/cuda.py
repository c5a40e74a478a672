"""The torch CUDA implementation of `IpcBackend`. Importing this module imports torch.

Export is torch's own CUDA IPC (`UntypedStorage._share_cuda_`: `cudaIpcGetMemHandle` of the caching
allocator's block, with the offset of the storage in it and torch's producer-side reference
counter, so the block is not reused while a peer holds it); open is
`torch.multiprocessing.reductions.rebuild_cuda_tensor` (`cudaIpcOpenMemHandle`, cached by torch per
handle). The handle travels as JSON of those fields, never as a pickle. Copies are `copy_` of byte
views (`cudaMemcpyAsync`, device to device; between two GPUs torch enables peer access) on one fabric
stream per device, after an event recorded on the producer's stream; completion is an event recorded
after them.

All ranks of a host must see the same devices under the same indices (do not narrow
`CUDA_VISIBLE_DEVICES` per rank: pick the device with `--device cuda:N`), since a handle names its
device by index.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from transfer.errors import TransferError
from transfer.ipc.logic import Piece

# buffers exported by this process, by handle: a handle cannot be opened in the process that made it
_EXPORTED: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class CudaEvent:
    """An event recorded after queued copies."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())


class CudaBuffer:
    """A contiguous CUDA tensor as flat bytes (this process's, or a peer's opened by handle)."""

    def __init__(self, tensor: Any) -> None:
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        self.tensor = tensor  # keeps the memory alive while registered
        self.bytes = tensor.detach().reshape(-1).view(torch.uint8)  # bytes of any dtype, bf16 included
        self.device = tensor.device

    @property
    def nbytes(self) -> int:
        return int(self.bytes.numel())


def _hex(value: bytes | None) -> str | None:
    return None if value is None else bytes(value).hex()


def _unhex(value: str | None) -> bytes | None:
    return None if value is None else bytes.fromhex(value)


class CudaIpcBackend:
    """`IpcBackend` on CUDA tensors, one fabric stream per device."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def memory_of(self, obj: object) -> CudaBuffer:
        return CudaBuffer(obj)

    def export(self, buffer: Any) -> bytes:
        data = buffer.bytes
        (device, handle, size, offset, ref_handle, ref_offset, event_handle,
         sync) = data.untyped_storage()._share_cuda_()
        fields = {"pid": os.getpid(), "device": device, "handle": _hex(handle), "size": size,
                  "offset": offset, "ref": _hex(ref_handle), "ref_offset": ref_offset,
                  "event": _hex(event_handle), "sync": bool(sync),
                  "tensor_offset": data.storage_offset(), "nbytes": buffer.nbytes}
        encoded = json.dumps(fields, sort_keys=True)
        _EXPORTED[encoded] = buffer
        return encoded.encode()

    def release(self, buffer: Any) -> None:
        del buffer  # torch counts the peers' references; the caller's tensor keeps the memory

    def open(self, handle: bytes) -> CudaBuffer:
        text = handle.decode()
        fields = json.loads(text)
        if fields["pid"] == os.getpid():
            mine = _EXPORTED.get(text)
            if mine is None:
                raise TransferError("an IPC handle of this process's buffer that is no longer registered")
            return mine
        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size([fields["nbytes"]]), (1,), fields["tensor_offset"], torch.UntypedStorage,
            torch.uint8, fields["device"], _unhex(fields["handle"]), fields["size"], fields["offset"], False,
            _unhex(fields["ref"]), fields["ref_offset"], _unhex(fields["event"]), fields["sync"],
        )
        return CudaBuffer(tensor)

    def producer_mark(self, buffer: Any) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(buffer.device))
        return event

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            return stream

    def copy(self, src: Any, dst: Any, pieces: Sequence[Piece], after: Any) -> CudaEvent:
        stream = self._stream(src.device)
        with torch.cuda.device(src.device), torch.cuda.stream(stream):
            stream.wait_event(after)
            for piece in pieces:
                dst.bytes[piece.dst : piece.dst + piece.nbytes].copy_(
                    src.bytes[piece.src : piece.src + piece.nbytes], non_blocking=True)
            return CudaEvent(stream.record_event())

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:  # copies still queued write into peers' memory: let them end
            stream.synchronize()
