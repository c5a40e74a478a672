"""Registered buffers: named, flat byte views of caller memory.

Accepted objects: `bytearray`, `memoryview`, anything with the buffer protocol (numpy arrays), and
CPU torch tensors (duck-typed: torch is imported lazily, only when a tensor is registered). The view
aliases the caller's memory: transfers write straight into it, no copy. Device memory (a CUDA tensor)
is not host memory: `device_type` names it, and the host fabrics refuse it with the reason (the
staging fabric, `transfer/staged`, takes CUDA tensors and copies through pinned host slots).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable
from typing import Any

from transfer.core import Segment


def _is_torch_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def device_type(obj: object) -> str:
    """Where `obj`'s memory is: "cpu" for host memory (buffers, numpy arrays, CPU tensors), else the
    torch device type of a tensor ("cuda", "meta", ...). Imports nothing."""
    if not _is_torch_tensor(obj):
        return "cpu"
    return str(getattr(getattr(obj, "device", None), "type", "cpu"))


def _tensor_bytes(tensor: Any) -> memoryview:
    torch = importlib.import_module("torch")  # the caller already has torch loaded: this is a lookup
    kind = device_type(tensor)
    if kind == "meta":
        raise ValueError("a meta tensor has no memory: no fabric can move its bytes")
    if kind != "cpu":
        raise ValueError(f"a {kind} tensor is device memory: it needs a device fabric (nccl, rdma) or host "
                         "staging (transfer/staged), not this host-memory fabric")
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be registered")
    flat = tensor.detach().reshape(-1).view(torch.uint8)  # bytes of any dtype, bf16 included
    return memoryview(flat.numpy())


def as_byte_view(obj: object) -> memoryview:
    """A flat unsigned-byte view of `obj`'s memory (no copy)."""
    if _is_torch_tensor(obj):
        return _tensor_bytes(obj)
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError as exc:
        raise TypeError(f"cannot register a {type(obj).__name__}: it has no buffer protocol") from exc
    if not view.c_contiguous:
        raise ValueError("only C-contiguous buffers can be registered")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


def check_segments(name: str, size: int, segments: Iterable[Segment]) -> None:
    """Raise `ValueError` if a segment leaves the buffer or has a negative length."""
    for offset, length in segments:
        if offset < 0 or length < 0 or offset + length > size:
            raise ValueError(f"segment ({offset}, {length}) is outside buffer {name!r} of {size} bytes")


class BufferRegistry:
    """Name → byte view, safe to use from several threads."""

    def __init__(self) -> None:
        self._views: dict[str, memoryview] = {}
        self._lock = threading.Lock()

    def register(self, name: str, obj: object) -> int:
        """Register (or replace) `name`; returns its size in bytes."""
        view = as_byte_view(obj)
        with self._lock:
            self._views[name] = view
        return view.nbytes

    def unregister(self, name: str) -> None:
        """Forget `name` (pending transfers keep their own views)."""
        with self._lock:
            self._views.pop(name, None)

    def view(self, name: str) -> memoryview:
        """The byte view registered as `name`."""
        with self._lock:
            try:
                return self._views[name]
            except KeyError:
                raise KeyError(f"no buffer registered as {name!r}") from None

    def slices(self, name: str, segments: Iterable[Segment], writable: bool) -> list[memoryview]:
        """Views of `segments` of buffer `name`, bounds-checked."""
        view = self.view(name)
        if writable and view.readonly:
            raise ValueError(f"buffer {name!r} is read-only: it cannot receive")
        segments = list(segments)
        check_segments(name, view.nbytes, segments)
        return [view[offset : offset + length] for offset, length in segments if length]

    def names(self) -> list[str]:
        """Registered names."""
        with self._lock:
            return list(self._views)
