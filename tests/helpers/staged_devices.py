"""A CPU double of device memory for the staging fabric (`transfer/staged`).

numpy arrays registered on a `StagedFabric` over `DoubleDevices` are "device memory": the fabric
only reaches them through `DoubleMemory`, which is not a buffer the inner fabric could touch. Like a
GPU, the double runs work on queues of its own ("streams", one thread each): `compute` for producer
kernels, `d2h` and `h2d` for copies, so copies are asynchronous and may be slow (`copy_delay_s`), and
a producer may write late (`launch`): a fabric that does not wait on the producer's mark or on a
copy's completion reads or hands over the wrong bytes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from transfer.core import Segments
from transfer.staged.device import HostSlot


class _Engine:
    """One queue of work run in order on its own thread (a CUDA stream)."""

    def __init__(self, name: str) -> None:
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def enqueue(self, work: Callable[[], None]) -> threading.Event:
        """Queue `work`; the event is set when it has run (an event recorded after it)."""
        done = threading.Event()

        def run() -> None:
            work()
            done.set()

        self._work.put(run)
        return done

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            work()

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=30)


class _Done:
    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event.is_set()


class DoubleMemory:
    """A numpy array as device memory (flat bytes)."""

    def __init__(self, devices: DoubleDevices, array: np.ndarray) -> None:
        self._devices = devices
        self.array = array
        self._bytes = array.reshape(-1).view(np.uint8)

    @property
    def nbytes(self) -> int:
        return int(self._bytes.nbytes)

    def ready_after_producer(self) -> object:
        self._devices.marks += 1
        return self._devices.compute.enqueue(lambda: None)  # set once every kernel queued so far ran

    def to_host(self, segments: Segments, slot: HostSlot, after: object) -> _Done:
        assert isinstance(after, threading.Event), "a send's copy must wait on the producer's mark"
        return _Done(self._devices.d2h.enqueue(partial(self._gather, list(segments), slot, after)))

    def from_host(self, slot: HostSlot, segments: Segments) -> _Done:
        return _Done(self._devices.h2d.enqueue(partial(self._scatter, slot, list(segments))))

    def _gather(self, segments: list[tuple[int, int]], slot: HostSlot, after: threading.Event) -> None:
        after.wait(30)
        time.sleep(self._devices.copy_delay_s)
        pos = 0
        for offset, length in segments:
            slot.view[pos : pos + length] = self._bytes[offset : offset + length].tobytes()
            pos += length

    def _scatter(self, slot: HostSlot, segments: list[tuple[int, int]]) -> None:
        time.sleep(self._devices.copy_delay_s)
        pos = 0
        for offset, length in segments:
            self._bytes[offset : offset + length] = np.frombuffer(slot.view[pos : pos + length], np.uint8)
            pos += length


class DoubleDevices:
    """`Devices` for the CPU tests: numpy arrays are device memory, anything else host memory."""

    def __init__(self, copy_delay_s: float = 0.0) -> None:
        self.copy_delay_s = copy_delay_s
        self.compute, self.d2h, self.h2d = (_Engine(f"double-{kind}") for kind in ("compute", "d2h", "h2d"))
        self.slots_made: list[int] = []  # sizes of the host slots allocated
        self.marks = 0  # producer marks taken

    def memory_of(self, obj: object) -> DoubleMemory | None:
        return DoubleMemory(self, obj) if isinstance(obj, np.ndarray) else None

    def host_slot(self, nbytes: int) -> HostSlot:
        self.slots_made.append(nbytes)
        memory = bytearray(nbytes)
        return HostSlot(memoryview(memory), memory)

    def launch(self, kernel: Callable[[], None], seconds: float = 0.0) -> None:
        """A producer kernel on the compute stream: runs `kernel` after `seconds`."""

        def run() -> None:
            time.sleep(seconds)
            kernel()

        self.compute.enqueue(run)

    def close(self) -> None:
        for engine in (self.compute, self.d2h, self.h2d):
            engine.close()
