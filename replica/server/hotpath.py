"""`HotPath`: the replica's end of the socket pair to its gRPC front process (`frontend.py`).

The calls a decode loop makes every step (DecodeV2, PrefillV2 NORMAL / Prefill, FilterBatch,
ClearCache) arrive here as already-converted engine arguments. One reader thread submits them to
the engine thread in the order they arrive; the engine thread itself sends each reply the moment
the work item ends (a future callback), so no gRPC thread of this process wakes up per step and
nothing here competes with the forward for the GIL beyond one unpickle and one pickle per call.

```
 front ──frame──► reader thread ── worker.submit(fn, undo) ──► engine thread ── reply frame ──► front
       ◄─cancel── (the caller gave up: the item is skipped, or undone once it ends if it was running)
```
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from replica.engine.engine import Engine
from replica.engine.types import BatchId, RequestId, StepResult
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
    if op == "decode":
        return partial(engine.decode, args), None, encode_step
    if op == "prefill":
        return partial(engine.prefill, args), partial(_drop_prefilled, engine), encode_step
    if op == "filter":
        batch_id, keep = args
        return partial(engine.filter, BatchId(batch_id), [RequestId(i) for i in keep]), None, encode_batch
    if op == "clear":
        return partial(engine.clear, args), None, lambda _: None
    raise InvalidArgument(f"unknown front-process operation {op!r}")


class HotPath:
    """Serves the front process's engine calls until the socket closes."""

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
        self._items: dict[int, WorkItem[Any]] = {}  # calls until they end (a cancel finds them here)
        self._closing = False
        self._on_lost = on_lost  # called when the front process went away unexpectedly
        self._thread = threading.Thread(target=self._loop, name="hotpath", daemon=True)

    def start(self) -> None:
        """Start reading calls."""
        self._thread.start()

    def close(self) -> None:
        """Close the socket (the front process then stops) and end the reader."""
        self._closing = True
        self.wire.close()
        self._thread.join(5.0)

    def _loop(self) -> None:
        while (message := self.wire.recv()) is not None:
            try:
                self._handle(message)
            except OSError:
                break  # the front is gone: its callers get UNAVAILABLE from gRPC
            except Exception:
                log.exception("front-process call %r failed before reaching the engine", message[:2])
        if not self._closing:
            log.error("the gRPC front process closed its socket")
            self._on_lost()

    def _handle(self, message: tuple[Any, ...]) -> None:
        op, call_id = message[0], message[1]
        if op == "cancel":
            item = self._items.pop(call_id, None)
            if item is not None:
                self.worker.abandon(item)
            return
        try:
            engine = self._engine()
            if engine is None:
                raise FailedPrecondition("the model is still loading")
            fn, undo, encode = _work(engine, op, message[2])
            item = self.worker.submit(fn, undo)
        except ReplicaError as exc:
            self.wire.send((call_id, False, (exc.status.value, str(exc) or type(exc).__name__)))
            return
        self._items[call_id] = item
        item.future.add_done_callback(partial(self._reply, call_id, item, encode))

    def _reply(
        self, call_id: int, item: WorkItem[Any], encode: Callable[[Any], Any], future: Future[Any]
    ) -> None:
        """Runs on the engine thread as the item ends (or on the reader if it was skipped)."""
        self._items.pop(call_id, None)
        with contextlib.suppress(OSError):  # the front is gone; the reader notices
            self.wire.send((call_id, *_outcome(item, future, encode)))


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
