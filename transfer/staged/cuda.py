"""The torch CUDA implementation of `DeviceMemory`: copy streams, events, pinned host slots.

Imported only when a CUDA tensor is registered (it imports torch). One device→host and one
host→device copy stream per device, so sends and receives overlap each other and the compute.
A send's copy waits on an event recorded on the producer's stream (the caller's current stream at
`send`), so it reads what the kernels queued before it wrote; a receive is complete when the event
after its host→device copy is, so a consumer launching after `wait` reads the landed bytes.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from transfer.core import Segments
from transfer.staged.device import DeviceMemory, HostSlot


class CudaCompletion:
    """A CUDA event recorded after a copy."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())


class _CopyStreams:
    def __init__(self, device: torch.device) -> None:
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)


class CudaMemory:
    """A contiguous CUDA tensor as flat bytes."""

    def __init__(self, tensor: Any, streams: _CopyStreams) -> None:
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        self._tensor = tensor  # keeps the memory alive while registered
        self._bytes = tensor.detach().reshape(-1).view(torch.uint8)  # bytes of any dtype, bf16 included
        self._device = tensor.device
        self._streams = streams

    @property
    def nbytes(self) -> int:
        return int(self._bytes.numel())

    def ready_after_producer(self) -> object:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def to_host(self, segments: Segments, slot: HostSlot, after: object) -> CudaCompletion:
        stream = self._streams.d2h
        host = slot.owner
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            stream.wait_event(after)  # type: ignore[arg-type]
            pos = 0
            for offset, length in segments:
                host[pos : pos + length].copy_(self._bytes[offset : offset + length], non_blocking=True)
                pos += length
            return CudaCompletion(stream.record_event())

    def from_host(self, slot: HostSlot, segments: Segments) -> CudaCompletion:
        stream = self._streams.h2d
        host = slot.owner
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            pos = 0
            for offset, length in segments:
                self._bytes[offset : offset + length].copy_(host[pos : pos + length], non_blocking=True)
                pos += length
            return CudaCompletion(stream.record_event())


class CudaDevices:
    """`Devices` for CUDA tensors; host slots are pinned torch tensors."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, _CopyStreams] = {}
        self._lock = threading.Lock()

    def memory_of(self, obj: object) -> DeviceMemory | None:
        device = obj.device  # type: ignore[attr-defined]
        with self._lock:
            streams = self._streams.get(device)
            if streams is None:
                streams = self._streams[device] = _CopyStreams(device)
        return CudaMemory(obj, streams)

    def host_slot(self, nbytes: int) -> HostSlot:
        pinned = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        return HostSlot(pinned.numpy().data.cast("B")[:nbytes], pinned)

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for pair in streams:  # copies still queued write into slots and device memory: let them end
            pair.d2h.synchronize()
            pair.h2d.synchronize()
