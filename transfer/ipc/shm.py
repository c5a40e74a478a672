"""`SharedMemoryBackend`: the `IpcBackend` on host memory, with the device's asynchrony kept.

numpy arrays play device memory (bytearrays and memoryviews stay host memory, for the control
fabric, as on a GPU host). An array made by `allocate` lives in a `multiprocessing.shared_memory`
segment, and its handle (the segment's name) opens in another process of the host; any other
array's handle opens only in this process. Copies run on a worker thread (the fabric stream) after
the producer mark, each batch after `copy_delay_s`, so a fabric that does not wait for a copy's
completion, or a copy that does not wait for the producer, reads or delivers stale bytes in the
tests. `launch(kernel)` queues a callable on a second worker thread, the producer's stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from transfer.buffers import as_byte_view
from transfer.errors import TransferError
from transfer.ipc.logic import Piece

_LOCAL: dict[str, memoryview] = {}  # handles of this process's non-shared arrays
_LOCAL_LOCK = threading.Lock()
_TOKENS = itertools.count()


class _Stream:
    """Callables run in order on one thread (a CUDA stream's order, on the host)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, work: Callable[[], None]) -> None:
        self._queue.put(work)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            work()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


class Mark:
    """An event: set once the work queued before it has run."""

    def __init__(self, done: bool = False) -> None:
        self.event = threading.Event()
        if done:
            self.event.set()

    def done(self) -> bool:
        return self.event.is_set()


class HostBuffer:
    """A registered array's bytes (or a peer's, opened)."""

    def __init__(self, view: memoryview, owner: object = None) -> None:
        self.view = view
        self.owner = owner

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    @property
    def address(self) -> int:
        if self.view.readonly or not self.view.nbytes:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self.view))


class SharedMemoryBackend:
    """`IpcBackend` double (see the module docstring); `wait_for_producer=False` breaks the ordering
    with the producer on purpose, for the test that shows the ordering test catches that."""

    def __init__(self, copy_delay_s: float = 0.0, wait_for_producer: bool = True) -> None:
        self.copy_delay_s = copy_delay_s
        self.wait_for_producer = wait_for_producer
        self._segments: list[tuple[int, int, shared_memory.SharedMemory]] = []  # start, size, segment
        self._opened: dict[str, shared_memory.SharedMemory] = {}
        self._copies: _Stream | None = None
        self._compute: _Stream | None = None
        self._lock = threading.Lock()

    # memory -------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> np.ndarray:
        """A zeroed uint8 array in a new shared-memory segment (its handle opens in other processes)."""
        segment = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        array: np.ndarray = np.ndarray((nbytes,), dtype=np.uint8, buffer=segment.buf)
        array[:] = 0
        with self._lock:
            self._segments.append((array.ctypes.data, nbytes, segment))
        return array

    def memory_of(self, obj: object) -> HostBuffer | None:
        if not isinstance(obj, np.ndarray):
            return None
        return HostBuffer(as_byte_view(obj), obj)

    def export(self, buffer: Any) -> bytes:
        address, nbytes = buffer.address, buffer.nbytes
        with self._lock:
            for start, size, segment in self._segments:
                if start <= address and address + nbytes <= start + size:
                    fields = {"shm": segment.name, "offset": address - start, "nbytes": nbytes}
                    return json.dumps(fields).encode()
        token = f"{os.getpid()}/{next(_TOKENS)}"
        with _LOCAL_LOCK:
            _LOCAL[token] = buffer.view
        return json.dumps({"local": token, "nbytes": nbytes}).encode()

    def release(self, buffer: Any) -> None:
        view = buffer.view
        with _LOCAL_LOCK:
            for token in [t for t, v in _LOCAL.items() if v is view]:
                del _LOCAL[token]

    def open(self, handle: bytes) -> HostBuffer:
        fields = json.loads(handle)
        if "local" in fields:
            with _LOCAL_LOCK:
                view = _LOCAL.get(fields["local"])
            if view is None:
                raise TransferError(f"handle {fields['local']} is not open in this process")
            return HostBuffer(view)
        with self._lock:
            segment = self._opened.get(fields["shm"])
            if segment is None:
                segment = shared_memory.SharedMemory(name=fields["shm"])
                # the creator owns the segment: this process's tracker must not unlink it at exit
                resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
                self._opened[fields["shm"]] = segment
        start, buf = fields["offset"], segment.buf
        assert buf is not None  # an attached segment has its mapping
        return HostBuffer(buf[start : start + fields["nbytes"]], segment)

    # streams ------------------------------------------------------------------------------

    def launch(self, kernel: Callable[[], None]) -> None:
        """Queue `kernel` on the producer's stream (a test's slow producer)."""
        with self._lock:
            if self._compute is None:
                self._compute = _Stream("ipc-double-compute")
            compute = self._compute
        compute.put(kernel)

    def producer_mark(self, buffer: Any) -> Mark:
        with self._lock:
            compute = self._compute
        if compute is None or not self.wait_for_producer:
            return Mark(done=True)
        mark = Mark()
        compute.put(mark.event.set)
        return mark

    def copy(self, src: Any, dst: Any, pieces: Sequence[Piece], after: Any) -> Mark:
        with self._lock:
            if self._copies is None:
                self._copies = _Stream("ipc-double-copies")
            copies = self._copies
        done = Mark()

        def run() -> None:
            after.event.wait()
            if self.copy_delay_s:
                time.sleep(self.copy_delay_s)
            for p in pieces:
                dst.view[p.dst : p.dst + p.nbytes] = src.view[p.src : p.src + p.nbytes]
            done.event.set()

        copies.put(run)
        return done

    def close(self) -> None:
        with self._lock:
            streams = [s for s in (self._compute, self._copies) if s is not None]
            self._compute = self._copies = None
            segments = [segment for _, _, segment in self._segments] + list(self._opened.values())
            created = {id(segment) for _, _, segment in self._segments}
            self._segments, self._opened = [], {}
        for stream in streams:
            stream.close()
        for segment in segments:
            if id(segment) in created:
                with contextlib.suppress(FileNotFoundError):
                    segment.unlink()
            with contextlib.suppress(BufferError):  # arrays over it may still be alive
                segment.close()
