"""`HotPath`: the replica's end of the socket pair to its gRPC front process (`frontend.py`).

The calls a decode loop makes every step (DecodeV2, PrefillV2 NORMAL / Prefill, FilterBatch,
ClearCache) arrive here as already-converted engine arguments. The engine thread reads them itself
whenever its queue is empty (`EngineWorker.attach`), in the order sent, and sends each reply the
moment the item ends (a future callback): no other thread of this process wakes up per call, and
nothing competes with the forward for the GIL beyond one unpickle and one pickle per call.

```
 front ──(op, id, args, deadline)──► engine thread: read, run, reply ──(id, ok, payload)──► front
```
A call whose deadline (CLOCK_MONOTONIC, shared by both processes) passed before it was read is
answered DEADLINE_EXCEEDED without running; a call whose caller gave up later still runs, and the
front frees a prefilled batch nobody will take (frontend.py).

Only these calls use this socket. Every other unary call of the service comes over the second
socket pair, the service channel (service_channel.py), read by a thread of its own: the engine
thread may be inside a long item (zigzag / layer-waiting prefill, progressive migration) that only
such a call can unblock, and decode steps never pay for reading it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from replica.engine.engine import Engine
from replica.engine.types import BatchId, DecodeInput, RequestId, StepResult
from replica.engine.worker import EngineWorker, WorkItem
from replica.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ReplicaError, Status
from replica.server.wire import FrameSocket, encode_batch, encode_step

log = logging.getLogger(__name__)

# op -> (engine call, undo when its caller gave up after it ran, result encoder)
_Work = tuple[Callable[[], Any], Callable[[Any], None] | None, Callable[[Any], Any]]


def _drop_prefilled(engine: Engine, result: StepResult) -> None:
    """Undo of a prefill whose caller is gone: drop the batch it cached."""
    if result.batch is not None and result.batch.id in engine.store:
        engine.clear(result.batch.id)


def _work(engine: Engine, op: str, args: Any) -> _Work:
    if op == "decode":  # (batch id, tokens) pairs: convert.decode_pairs_from_pb
        inputs = [DecodeInput(BatchId(batch_id), tokens) for batch_id, tokens in args]
        return partial(engine.decode, inputs), None, encode_step
    if op == "prefill":
        return partial(engine.prefill, args), partial(_drop_prefilled, engine), encode_step
    if op == "filter":
        batch_id, keep = args
        return partial(engine.filter, BatchId(batch_id), [RequestId(i) for i in keep]), None, encode_batch
    if op == "clear":
        return partial(engine.clear, args), None, lambda _: None
    raise InvalidArgument(f"unknown front-process operation {op!r}")


class HotPath:
    """Serves the front process's engine calls, read by the engine thread itself, until EOF."""

    def __init__(
        self,
        wire: FrameSocket,
        worker: EngineWorker,
        engine: Callable[[], Engine | None],
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self.wire = wire
        self.worker = worker
        self._engine = engine  # None while the model loads (calls answer FAILED_PRECONDITION)
        self._closing = False
        self._on_lost = on_lost  # called when the front process went away unexpectedly
        self._detached = threading.Event()

    def start(self) -> None:
        """Let the engine thread serve the socket."""
        self.worker.attach(self.wire.sock, self._read)

    def close(self) -> None:
        """Shut the socket (the front process then stops); closed once the engine thread let go."""
        self._closing = True
        self.wire.shutdown()
        self._detached.wait(10.0)  # the engine thread sees EOF after the item it is running
        self.wire.close()

    def _read(self) -> WorkItem[Any] | None:
        """On the engine thread: one call from the socket, as an item to run now."""
        message = self.wire.recv()
        if message is None:
            self.worker.detach()
            self._detached.set()
            if not self._closing:
                log.error("the gRPC front process closed its socket")
                self._on_lost()
            return None
        op, call_id, args, deadline = message
        try:
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded("the call's deadline passed before the engine started it")
            engine = self._engine()
            if engine is None:
                raise FailedPrecondition("the model is still loading")
            fn, undo, encode = _work(engine, op, args)
        except ReplicaError as exc:
            self._send((call_id, False, (exc.status.value, str(exc) or type(exc).__name__)))
            return None
        item = WorkItem(fn, undo)
        item.future.add_done_callback(partial(self._reply, call_id, item, encode))
        return item

    def _reply(
        self, call_id: int, item: WorkItem[Any], encode: Callable[[Any], Any], future: Future[Any]
    ) -> None:
        """Runs on the engine thread as the item ends."""
        self._send((call_id, *_outcome(item, future, encode)))

    def _send(self, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # the front is gone; the next read sees EOF
            self.wire.send(message)


def _outcome(item: WorkItem[Any], future: Future[Any], encode: Callable[[Any], Any]) -> tuple[bool, Any]:
    if future.cancelled() or item.abandoned:
        return False, (DeadlineExceeded.status.value, "the caller gave up before the engine finished")
    exc = future.exception()
    if exc is None:
        return True, encode(future.result())
    if isinstance(exc, ReplicaError):
        return False, (exc.status.value, str(exc) or type(exc).__name__)
    log.error("engine call failed", exc_info=exc)
    return False, (Status.INTERNAL.value, f"{type(exc).__name__}: {exc}")
