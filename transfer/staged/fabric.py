"""`StagedFabric`: a host-memory fabric (tcp) that also moves device buffers, through host slots.

```
 send(peer, "kv", segs) ─► producer mark ─► [lane (peer, stream, out)]  slot k:   D→H copy ─► inner send
   (caller's thread:                          FIFO, posting order        slot k+1: D→H copy   (on the
    its current stream)                       ≤ depth slots              while k is on the socket)
 recv(peer, "kv", segs) ─► [lane (peer, stream, in)] ─► inner recv into slot ─► H→D copy ─► handle done
```
A device buffer (`Devices.memory_of` says which) is never mirrored: a send takes a staging slot of
its lane, queues one device→host copy per segment after an event on the producer's stream (the
caller's current stream at `send`), and posts the inner send of the slot once the copy is done;
the slot returns to the lane when the inner send completes. A receive posts the inner receive into
a slot and, when it completes, copies the slot to the device segments; the handle completes after
that copy, so whoever waits on it finds the bytes on the device. Host buffers go to the inner fabric
as they are (straight through when nothing staged is queued ahead of them on their lane).

Every message of a lane reaches the inner fabric in posting order, staged or not, so the inner
fabric's matching rule holds. Errors, deadlines, `abort`, `withdraw`, `refresh`, `connect` and
`close` are the inner fabric's; device copies run on their own and end by themselves, so the
worker thread that polls them never waits without end.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from transfer.buffers import check_segments
from transfer.core import Deadline, Handle, Segment, Segments, total_length
from transfer.errors import FabricClosed, PeerGone, TransferError
from transfer.fabric import Fabric
from transfer.staged.device import Completion, DeviceMemory, Devices, TorchDevices
from transfer.staged.slots import Slot, SlotPool, StagingBudget

_POLL_S = 0.0002  # while device copies are in flight
_EMPTY = "__staged:empty"  # a zero-byte host buffer for empty messages of device buffers


class JobState(enum.Enum):
    """Where one posted message is."""

    WAITING = "waiting"  # on its lane: no slot yet, or behind messages ahead of it
    COPYING = "copying"  # send: device → slot copy running
    READY = "ready"  # send: its bytes are in the slot
    POSTED = "posted"  # the inner fabric has it
    LANDING = "landing"  # receive: slot → device copy running
    DONE = "done"


@dataclass(eq=False)
class _Lane:
    peer: int
    stream: int
    sending: bool
    pool: SlotPool
    queue: deque[_Job] = field(default_factory=deque)  # not yet handed to the inner fabric, in order
    post_lock: threading.Lock = field(default_factory=threading.Lock)  # inner posts in queue order


@dataclass(eq=False)
class _Job:
    handle: Handle
    lane: _Lane
    name: str  # the buffer (inner name for host jobs)
    segments: list[Segment]
    deadline: Deadline
    memory: DeviceMemory | None = None  # None: host memory, the inner fabric moves it as it is
    after: object = None  # the producer mark a send's copy waits on
    state: JobState = JobState.WAITING
    slot: Slot | None = None
    copy: Completion | None = None
    inner: Handle | None = None
    error: TransferError | None = None
    withdrawn: bool = False  # its inner receive is being taken back: its failure is no connection's


Finished = list[tuple[Handle, TransferError | None]]


class StagedFabric(Fabric):
    """Wraps host-memory fabric `inner`; device buffers are staged through `depth` host slots per
    (peer, stream, direction), all lanes within `max_staging_bytes` (see `slots.py`)."""

    def __init__(self, inner: Fabric, devices: Devices | None = None, depth: int = 4,
                 max_staging_bytes: int = 1 << 30) -> None:
        super().__init__(inner.table, inner.rank)
        self.inner = inner
        self.devices: Devices = devices if devices is not None else TorchDevices()
        self.depth = depth
        self.budget = StagingBudget(max_staging_bytes)
        self._memory: dict[str, DeviceMemory] = {}
        self._lanes: dict[tuple[int, int, bool], _Lane] = {}
        self._receives: dict[Handle, _Job] = {}  # for withdraw
        self._copying: list[_Job] = []
        self._lock = threading.Lock()  # lanes, jobs, slots; never held while posting to the inner fabric
        self._closed = False
        self._cond = threading.Condition()  # the worker's inbox
        self._inbox: list[Callable[[Finished], None]] = []  # run by the worker under `_lock`
        self._kicked = self._stopping = False
        inner.register(_EMPTY, bytearray(0))
        self._worker = threading.Thread(target=self._run, name=f"staged-{self.rank}", daemon=True)
        self._worker.start()

    # buffers and layouts ------------------------------------------------------------------

    def register(self, name: str, obj: object) -> int:
        memory = self.devices.memory_of(obj)
        if memory is None:
            size = self.inner.register(name, obj)
            with self._lock:
                self._memory.pop(name, None)
            return size
        self.inner.unregister(name)
        with self._lock:
            self._memory[name] = memory
        return memory.nbytes

    def unregister(self, name: str) -> None:
        with self._lock:
            self._memory.pop(name, None)
        self.inner.unregister(name)

    def set_layout(self, stream: int, descriptor: str) -> None:
        self.inner.set_layout(stream, descriptor)

    def slots_in_use(self) -> int:
        """Staging slots holding a message now, all lanes together."""
        with self._lock:
            return sum(lane.pool.in_use() for lane in self._lanes.values())

    def staging_bytes(self) -> int:
        """Host staging memory allocated now, all lanes together."""
        with self._lock:
            return self.budget.allocated

    # posting ------------------------------------------------------------------------------

    def send(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._post(peer, name, list(segments), stream, deadline, sending=True)

    def recv(self, peer: int, name: str, segments: Segments, stream: int, deadline: Deadline) -> Handle:
        return self._post(peer, name, list(segments), stream, deadline, sending=False)

    def _post(self, peer: int, name: str, segments: list[Segment], stream: int, deadline: Deadline,
              sending: bool) -> Handle:
        with self._lock:
            memory = self._memory.get(name)
        nbytes = total_length(segments)
        after = None
        if memory is not None:
            check_segments(name, memory.nbytes, segments)
            if nbytes > self.budget.max_bytes:
                raise ValueError(f"a message of {nbytes} bytes is more than the staging budget of "
                                 f"{self.budget.max_bytes}: cut it (collectives send chunk_bytes pieces)")
            if nbytes == 0:
                memory, name, segments = None, _EMPTY, []
            elif sending:
                after = memory.ready_after_producer()  # here: the caller's current stream is the producer's
        verb = "send to" if sending else "recv from"
        handle = Handle(nbytes, f"rank {self.rank} {verb} {peer} stream {stream} (staged)",
                        lambda: self.abort(peer, stream, "deadline passed"))
        lane = self._lane(peer, stream, sending)
        job = _Job(handle, lane, name, segments, deadline, memory, after)
        with lane.post_lock:
            with self._lock:
                if self._closed:
                    raise FabricClosed(f"rank {self.rank}: fabric closed")
                if not sending:
                    self._receives[handle] = job
                direct = memory is None and not lane.queue  # nothing staged ahead: straight through
                if direct:
                    job.state = JobState.POSTED
                else:
                    lane.queue.append(job)
            if direct:
                self._post_inner(job)
        if not direct:
            self._kick()
        return handle

    def _lane(self, peer: int, stream: int, sending: bool) -> _Lane:
        with self._lock:
            lane = self._lanes.get((peer, stream, sending))
            if lane is None:
                prefix = f"__staged:{peer}:{stream}:{'out' if sending else 'in'}"
                pool = SlotPool(prefix, self.depth, self.budget, self.devices.host_slot, self._install)
                lane = self._lanes[(peer, stream, sending)] = _Lane(peer, stream, sending, pool)
            return lane

    def _install(self, slot: Slot) -> None:
        assert slot.host is not None
        self.inner.register(slot.name, slot.host.view)

    def _post_inner(self, job: _Job) -> None:
        """Hand `job` to the inner fabric (under its lane's post_lock, never under `_lock`)."""
        lane = job.lane
        if job.slot is not None:
            name, segments = job.slot.name, [(0, job.handle.nbytes)]
        else:
            name, segments = job.name, job.segments
        post = self.inner.send if lane.sending else self.inner.recv
        try:
            inner = post(lane.peer, name, segments, lane.stream, job.deadline)
        except TransferError as exc:
            inner = Handle(job.handle.nbytes, job.handle.description)
            inner._fail(exc)
        except (KeyError, ValueError) as exc:  # a host buffer unregistered while the job waited
            inner = Handle(job.handle.nbytes, job.handle.description)
            inner._fail(TransferError(f"{job.handle.description}: {exc}"))
        job.inner = inner
        inner.add_done_callback(lambda h: self._deliver(partial(self._inner_done, job, h)))

    def _deliver(self, action: Callable[[Finished], None]) -> None:
        with self._cond:  # on the inner fabric's thread (or the poster's): only hand over
            self._inbox.append(action)
            self._cond.notify()

    def _kick(self) -> None:
        with self._cond:
            self._kicked = True
            self._cond.notify()

    # the worker ---------------------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        while True:
            with self._cond:
                if not self._inbox and not self._kicked and not self._stopping:
                    self._cond.wait(_POLL_S if busy else None)
                completed, self._inbox = self._inbox, []
                self._kicked = False
                stopping = self._stopping
            busy = self._step(completed)
            if stopping and not busy and not completed:
                return

    def _step(self, completed: list[Callable[[Finished], None]]) -> bool:
        """Advance every lane once; returns whether device copies are still in flight."""
        finished: Finished = []
        with self._lock:
            for action in completed:
                action(finished)
            self._poll_copies(finished)
            lanes = list(self._lanes.values())
            for lane in lanes:
                if lane.sending:
                    self._start_copies(lane, finished)
            busy = bool(self._copying)
        for lane in lanes:
            self._post_ready(lane, finished)
        for handle, error in finished:
            handle._finish(error)
        return busy

    def _inner_done(self, job: _Job, inner: Handle, finished: Finished) -> None:
        error = job.error or inner.error
        if inner.error is not None and job.error is None and not job.withdrawn:
            self._connection_failed(job.lane, inner.error, finished)
        if job.lane.sending or error is not None or job.slot is None or job.memory is None:
            self._finish(job, error, finished)
            return
        try:
            job.copy = job.memory.from_host(job.slot.host, job.segments)  # type: ignore[arg-type]
        except Exception as exc:  # a device error: this message is lost, the fabric is not
            self._finish(job, TransferError(f"{job.handle.description}: host→device copy: {exc}"), finished)
            return
        job.state = JobState.LANDING
        self._copying.append(job)

    def _poll_copies(self, finished: Finished) -> None:
        still: list[_Job] = []
        for job in self._copying:
            if job.copy is not None and not job.copy.done():
                still.append(job)
            elif job.state is JobState.LANDING or job.error is not None:
                if job in job.lane.queue:  # a send whose copy failed: the lane goes on without it
                    job.lane.queue.remove(job)
                self._finish(job, job.error, finished)
            else:
                job.state = JobState.READY
        self._copying = still

    def _start_copies(self, lane: _Lane, finished: Finished) -> None:
        for job in lane.queue:
            if job.state is not JobState.WAITING or job.memory is None:
                continue
            slot = lane.pool.acquire(job.handle.nbytes)
            if slot is None:
                return  # the lane's slots are all in flight: the next release starts this one
            job.slot = slot
            try:
                job.copy = job.memory.to_host(job.segments, slot.host, job.after)  # type: ignore[arg-type]
            except Exception as exc:
                job.copy = None
                job.error = TransferError(f"{job.handle.description}: device→host copy: {exc}")
                finished.append((job.handle, job.error))
            job.state = JobState.COPYING
            self._copying.append(job)

    def _post_ready(self, lane: _Lane, finished: Finished) -> None:
        with lane.post_lock:
            ready: list[_Job] = []
            with self._lock:
                while lane.queue and self._postable(lane, lane.queue[0]):
                    job = lane.queue.popleft()
                    job.state = JobState.POSTED
                    ready.append(job)
            for job in ready:
                self._post_inner(job)

    def _postable(self, lane: _Lane, job: _Job) -> bool:
        if job.memory is None:
            return True
        if lane.sending:
            return job.state is JobState.READY
        job.slot = lane.pool.acquire(job.handle.nbytes)
        return job.slot is not None

    def _finish(self, job: _Job, error: TransferError | None, finished: Finished) -> None:
        """`job` is over: its slot goes back to the lane, its handle completes (outside the lock)."""
        if job.slot is not None:
            job.lane.pool.release(job.slot)
            job.slot = None
        job.state = JobState.DONE
        self._receives.pop(job.handle, None)
        finished.append((job.handle, error))

    # failures -----------------------------------------------------------------------------

    def _fail_lane(self, lane: _Lane, error: TransferError, finished: Finished) -> None:
        """Fail what `lane` holds (under `_lock`); slots under a running copy return when it ends."""
        self._connection_failed(lane, error, finished)
        for job in self._copying:
            if job.lane is lane and job.state is JobState.LANDING:
                job.error = error
                finished.append((job.handle, error))

    def _connection_failed(self, lane: _Lane, error: TransferError, finished: Finished) -> None:
        """The inner fabric failed a message of `lane`, so it failed everything pending on that
        connection: what still waits here (posted before, held back for a slot or a copy) fails too,
        as it would have in the inner fabric's queue, instead of reaching a new connection later."""
        for job in lane.queue:
            job.error = error
            if job.state is JobState.COPYING:
                finished.append((job.handle, error))
            else:
                self._finish(job, error, finished)
        lane.queue.clear()

    def _connect_done(self, peer: int, stream: int, handle: Handle, finished: Finished) -> None:
        lane = self._lanes.get((peer, stream, True))
        if handle.error is not None and lane is not None:
            self._connection_failed(lane, handle.error, finished)

    def abort(self, peer: int, stream: int, reason: str) -> None:
        error = PeerGone(f"rank {self.rank} aborted transfers with rank {peer}, stream {stream}: {reason}")
        with self._lock:
            lanes = [lane for key in ((peer, stream, True), (peer, stream, False))
                     if (lane := self._lanes.get(key)) is not None]
        finished: Finished = []
        for lane in lanes:
            with lane.post_lock, self._lock:  # nothing of this lane is half-way to the inner fabric
                self._fail_lane(lane, error, finished)
        self.inner.abort(peer, stream, reason)  # what it holds fails with its own error
        for handle, failure in finished:
            handle._finish(failure)

    def withdraw(self, peer: int, stream: int, handle: Handle, error: TransferError) -> bool:
        with self._lock:
            lane = self._lanes.get((peer, stream, False))
        if lane is None:
            return False
        with lane.post_lock:
            with self._lock:
                job = self._receives.get(handle)
                if job is None or handle.done() or job.state not in (JobState.WAITING, JobState.POSTED):
                    return False
                if job.state is JobState.WAITING:  # still ours: it leaves the queue as if never posted
                    lane.queue.remove(job)
                    self._finish(job, error, [])
                    taken = True
                else:
                    taken, job.withdrawn = False, True
                inner = job.inner
            if not taken:
                assert inner is not None
                taken = self.inner.withdraw(peer, stream, inner, error)  # its slot returns via _deliver
                if not taken:
                    with self._lock:
                        job.withdrawn = False
        if taken:
            handle._fail(error)
        return taken

    def connect(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        handle = self.inner.connect(peer, stream, deadline)
        handle.add_done_callback(lambda h: self._deliver(partial(self._connect_done, peer, stream, h)))
        return handle

    def warm(self, peer: int, stream: int, deadline: Deadline) -> Handle:
        return self.inner.warm(peer, stream, deadline)

    def refresh(self, peer: int, stream: int) -> None:
        with self._lock:
            lane = self._lanes.get((peer, stream, True))
            busy = lane is not None and bool(lane.queue)
        if not busy:
            self.inner.refresh(peer, stream)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lanes = list(self._lanes.values())
        error = FabricClosed(f"rank {self.rank}: fabric closed")
        finished: Finished = []
        for lane in lanes:
            with lane.post_lock, self._lock:
                self._fail_lane(lane, error, finished)
        self.inner.close()  # fails what it holds: the callbacks reach the worker before it stops
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._worker.join(timeout=30)
        self.devices.close()
        for handle, failure in finished:
            handle._finish(failure)
