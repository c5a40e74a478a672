"""`EngineLane`, `ServiceLane`: the replica's end of the front process's two socket pairs, serving the core.

```
 hot socket ──Request(ENGINE call)──► engine thread reads it when its queue is empty
                                      (EngineWorker.attach), runs core.engine_work, and sends
            ◄──Reply───────────────── the reply as the item ends (a future callback)
 service socket ──Request(SERVICE call)──► the service thread that read it runs core.run(call, ctx)
                ──Cancel(id)────────────► that call's context is cancelled (its waits stop)
                ◄──Reply, once per call── ; ctx.finish() after it (put-off work runs then)
                ◄──Serving(bool)───────── the grpc.health.v1 status the front publishes
```
Per hot call the engine process spends one decode and one encode (both in C) and wakes no other
thread. The service threads take turns reading (leader / followers): the one that read a call
runs it while another reads on, so a call starts without a hand-off, at most `workers` run at
once, and a Cancel never waits behind running calls. They are never the engine thread, which may
be inside a long item (a layer-waiting prefill, a progressive migration) only such a call can
unblock. If the front closes a socket unexpectedly, `on_lost` runs (the replica then stops).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from replica.engine.worker import EngineWorker, WorkItem
from replica.errors import ReplicaError
from replica.server.calls import CallContext
from replica.server.core import ReplicaCore, as_replica_error
from replica.server.frames import Cancel, Failure, FrameSocket, Reply, Request, Serving

log = logging.getLogger(__name__)


def failure(exc: ReplicaError) -> Failure:
    """An error as it travels back to the front."""
    return Failure(exc.status.value, str(exc) or type(exc).__name__, exc.cause)


def send_reply(wire: FrameSocket, reply: Reply) -> None:
    """Answer a call; a value that does not encode (a bug of ours) is answered INTERNAL instead."""
    try:
        wire.send(reply)
    except OSError:
        pass  # the front is gone; the next read sees EOF
    except Exception as exc:
        log.exception("the reply to call %d could not be encoded", reply.call_id)
        with contextlib.suppress(OSError):
            wire.send(Reply(reply.call_id, failure=Failure("INTERNAL", f"{type(exc).__name__}: {exc}")))


class EngineLane:
    """The hot socket, read and answered by the engine thread itself, until EOF."""

    def __init__(
        self, wire: FrameSocket, worker: EngineWorker, core: ReplicaCore, on_lost: Callable[[], None]
    ) -> None:
        self.wire = wire
        self.worker = worker
        self.core = core
        self._closing = False
        self._on_lost = on_lost
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
        if not isinstance(message, Request):
            log.error("unexpected frame on the hot socket: %s", type(message).__name__)
            return None
        try:
            item: WorkItem[Any] = WorkItem(self.core.engine_work(message.call, message.deadline))
        except ReplicaError as exc:
            self._send(Reply(message.call_id, failure=failure(exc)))
            return None
        item.future.add_done_callback(partial(self._reply, message.call_id))
        return item

    def _reply(self, call_id: int, future: Future[Any]) -> None:
        """On the engine thread, as the item ends."""
        exc = future.exception()
        if exc is None:
            self._send(Reply(call_id, future.result()))
        else:
            self._send(Reply(call_id, failure=failure(as_replica_error(exc))))

    def _send(self, reply: Reply) -> None:
        send_reply(self.wire, reply)


@dataclass(frozen=True)
class _Call:
    """A call read from the service socket, to be run by a service thread."""

    request: Request
    ctx: CallContext


class ServiceLane:
    """The service socket: threads that take turns reading, each running the call it read."""

    def __init__(
        self, wire: FrameSocket, core: ReplicaCore, workers: int, on_lost: Callable[[], None]
    ) -> None:
        self.wire = wire
        self.core = core
        self._workers = workers
        self._on_lost = on_lost
        self._closing = False
        self._calls: dict[int, CallContext] = {}  # running calls, for Cancel
        self._lock = threading.Lock()  # guards the fields below and `_calls`
        self._read_lock = threading.Lock()  # held by the thread reading the socket
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads reading or waiting to read
        self._running = 0  # threads running a call
        self._waiting: deque[_Call] = deque()  # read while `workers` calls were running
        self._ended = threading.Event()  # the socket closed and its end was handled

    def start(self) -> None:
        """Start reading calls (two threads: one reads, one is ready to take over)."""
        with self._lock:
            self._spawn()
            self._spawn()

    def publish(self, serving: bool) -> None:
        """Tell the front what grpc.health.v1 should say."""
        with contextlib.suppress(OSError):
            self.wire.send(Serving(serving))

    def expect_close(self) -> None:
        """The replica is stopping its front: the socket closing is not a loss."""
        self._closing = True

    def close(self) -> None:
        """Shut the socket, cancel every running call (their waits stop), then close it."""
        self._closing = True
        self.wire.shutdown()
        self._ended.wait(10.0)
        self.wire.close()

    def _spawn(self) -> None:
        """(Holding `_lock`) one more thread, idle: it waits for its turn to read."""
        self._idle += 1
        thread = threading.Thread(target=self._loop, name=f"service-{len(self._threads)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _loop(self) -> None:
        while True:
            with self._read_lock:
                try:
                    message = None if self._ended.is_set() else self.wire.recv()
                except Exception:  # a frame that does not decode: drop it, keep serving
                    log.exception("a frame of the service socket could not be read")
                    continue
                if message is None:
                    self._end()
                    return
                call = self._take(message)
            while call is not None:
                self._serve(call)
                call = self._next_waiting()

    def _end(self) -> None:
        """(Holding the read lock) the front closed the socket: cancel every call, once."""
        with self._lock:
            self._idle -= 1
            if self._ended.is_set():
                return
            running, self._calls = list(self._calls.values()), {}
            self._waiting.clear()
        for ctx in running:  # nobody can receive their answers now
            ctx.cancel()
        if not self._closing:
            log.error("the gRPC front process closed its service socket")
            self._on_lost()
        self._ended.set()

    def _take(self, message: Any) -> _Call | None:
        """(Holding the read lock) handle a frame; a call this thread should run now is returned."""
        if isinstance(message, Cancel):
            with self._lock:
                ctx = self._calls.get(message.call_id)
            if ctx is not None:
                ctx.cancel()
            return None
        if not isinstance(message, Request):
            log.error("unexpected frame on the service socket: %s", type(message).__name__)
            return None
        call = _Call(message, CallContext(message.deadline))
        with self._lock:
            self._calls[message.call_id] = call.ctx
            if self._running >= self._workers:
                self._waiting.append(call)
                return None
            self._running += 1
            self._idle -= 1
            if self._idle == 0:
                self._spawn()  # someone must read while this thread runs the call
        return call

    def _next_waiting(self) -> _Call | None:
        """A call that waited for a thread, or None (this thread goes back to reading)."""
        with self._lock:
            if self._waiting:
                return self._waiting.popleft()
            self._running -= 1
            self._idle += 1
            return None

    def _serve(self, call: _Call) -> None:
        """Run the call and answer it (exactly once, whatever happens); then finish its context."""
        request = call.request
        reply = Reply(request.call_id, failure=Failure("INTERNAL", "the call ended without an answer"))
        try:
            reply = Reply(request.call_id, self.core.run(request.call, call.ctx))
        except Exception as exc:
            reply = Reply(request.call_id, failure=failure(as_replica_error(exc)))
        finally:
            with self._lock:
                self._calls.pop(request.call_id, None)
            send_reply(self.wire, reply)
            call.ctx.finish()

