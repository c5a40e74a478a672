"""`ServiceChannel`: the replica's end of the front process's second socket pair, the service channel.

Every TextGenerationService unary call that is not hot (Migrate, Immigrate, the partial halves,
PrefillV2's weight / migration cases, LoadParams, Send/RecvParams, broadcasts, ZagPrefill, Relay,
Health, Info, Warmup, ...) arrives here as its serialized request instead of over a second gRPC
hop. Threads of its own take the frames — never the engine thread, which may be inside a long
item (a zigzag or layer-waiting prefill, a progressive migration) that only such a call can
unblock — and run `ReplicaServicer`'s method behind the same `interceptor.guard` as on the gRPC
server, with a `FrameContext` in place of `grpc.ServicerContext`. They take turns reading (leader /
followers, see `ServiceChannel`): the thread that read a call runs it, another reads on, so a call
starts without a hand-off to another thread. Decode steps never wake these threads.

```
 front ──("rpc", id, (method, request bytes, metadata), deadline)──► the reading thread runs it
       ──("cancel", id, None, None)──► the call's context ends: is_active() False, callbacks run
       ◄── (id, True, response bytes) | (id, False, (grpc code name, details)) ── that thread, once
```
A call whose deadline (CLOCK_MONOTONIC, shared by both processes) passed before it was read is
answered DEADLINE_EXCEEDED without running. The front sends "cancel" when its caller cancels or
the deadline passes; the reply still comes (exactly once per call) and the front drops it.
If the front closes the socket unexpectedly, `on_lost` runs (the replica then stops).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import grpc
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from protos import generate_pb2 as pb
from replica.errors import CAUSE_KEY
from replica.server.interceptor import guard
from replica.server.wire import FrameSocket

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["TextGenerationService"]

Metadata = tuple[tuple[str, str | bytes], ...]


class CallAborted(Exception):
    """Raised by `FrameContext.abort`, like grpc's own abort: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str, cause: str | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.cause = cause  # the `x-pdcluster-cause` trailing metadata, if it was set


class FrameContext:
    """What `ReplicaServicer` and its helpers use of `grpc.ServicerContext`, for a call over frames.

    - `time_remaining()`: seconds to the call's deadline (None without one; grpc reports a huge
      number there, which the servicer's helpers also read as "none").
    - `is_active()`: False once the caller cancelled, the deadline passed or the call ended.
    - `invocation_metadata()`: the caller's metadata as the front passed it on.
    - `add_callback(fn)`: `fn` runs once when the call ends (answered, cancelled, or the replica
      closes the channel); False if it already ended.
    - `set_trailing_metadata(pairs)`: kept for `abort` (only `x-pdcluster-cause` travels back).
    - `abort(code, details)`: raises `CallAborted` (grpc's abort raises too); the call ends with it.
    """

    def __init__(self, metadata: Sequence[tuple[str, str | bytes]], deadline: float | None) -> None:
        self._metadata: Metadata = tuple((str(k), v) for k, v in metadata)
        self._deadline = deadline  # time.monotonic() value
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []  # None once the call ended
        self._trailing: Metadata = ()

    def invocation_metadata(self) -> Metadata:
        """The caller's metadata (key, value) pairs."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds left before the deadline (never negative), None without a deadline."""
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def is_active(self) -> bool:
        """Whether the caller still waits for the answer."""
        with self._lock:
            ended = self._callbacks is None
        return not ended and (self._deadline is None or time.monotonic() < self._deadline)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Run `callback` when the call ends; False (not registered) if it has ended already."""
        with self._lock:
            if self._callbacks is None:
                return False
            self._callbacks.append(callback)
            return True

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        """Metadata to end the call with."""
        self._trailing = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """End the call with `code` and `details` (raises `CallAborted`)."""
        cause = next((str(v) for k, v in self._trailing if k == CAUSE_KEY), None)
        raise CallAborted(code, details, cause)

    def end(self) -> None:
        """The call is over (answered or cancelled): run the callbacks, once."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback()
            except Exception:
                log.exception("a call's end callback failed")


@dataclass(frozen=True)
class _Method:
    """One unary method of the service: the servicer's bound method and its request type."""

    fn: Callable[[Any, grpc.ServicerContext], Any]
    request: type[Message]


def unary_methods(servicer: object) -> dict[str, _Method]:
    """The servicer's unary-unary methods by full gRPC path (`/generate.v2.TextGenerationService/X`)."""
    return {
        f"/{SERVICE.full_name}/{m.name}": _Method(getattr(servicer, m.name), GetMessageClass(m.input_type))
        for m in SERVICE.methods
        if not (m.client_streaming or m.server_streaming)
    }


# (ok, response bytes) or (not ok, (grpc code name, details, cause or None))
_Reply = tuple[bool, Any]


@dataclass(frozen=True)
class _Call:
    """A call read from the channel, to be run by a thread of the channel."""

    call_id: int
    method: str
    data: bytes
    context: FrameContext


class ServiceChannel:
    """Serves the front's forwarded calls with threads that take turns reading (leader / followers).

    One thread at a time reads the socket. When it reads a call, it hands the reading to an idle
    thread (one waiting for the read lock, started if there is none) and runs the call itself: the
    call starts without waking another thread first. At most `workers` calls run at once; calls
    read beyond that wait, in order, for a thread that finishes one. "cancel" frames are handled
    by whichever thread reads them, so a cancel never waits behind running calls.
    """

    def __init__(
        self,
        wire: FrameSocket,
        servicer: object,
        workers: int,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self.wire = wire
        self._methods = unary_methods(servicer)
        self._workers = workers
        self._on_lost = on_lost  # called when the front process went away unexpectedly
        self._closing = False
        self._calls: dict[int, FrameContext] = {}  # running calls, for "cancel"
        self._lock = threading.Lock()  # guards the fields below and `_calls`
        self._read_lock = threading.Lock()  # held by the thread reading the socket
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads reading or waiting to read
        self._running = 0  # threads running a call
        self._waiting: deque[_Call] = deque()  # read while `workers` calls were running
        self._ended = threading.Event()  # the channel closed and its end was handled

    def start(self) -> None:
        """Start reading calls (two threads: one reads, one is ready to take over)."""
        with self._lock:
            self._spawn()
            self._spawn()

    def expect_close(self) -> None:
        """The replica is stopping its front: its end of the channel closing is not a loss."""
        self._closing = True

    def close(self) -> None:
        """Shut the socket, end every running call (their callbacks run), then close it."""
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
                message = None if self._ended.is_set() else self.wire.recv()
                if message is None:
                    self._end()
                    return
                try:
                    call = self._take(message)
                except Exception:
                    log.exception("a frame of the service channel could not be handled")
                    call = None
            while call is not None:
                self._serve(call)
                call = self._next_waiting()

    def _end(self) -> None:
        """(Holding the read lock) the front closed the channel: end every call, once."""
        with self._lock:
            self._idle -= 1
            if self._ended.is_set():
                return
            running, self._calls = list(self._calls.values()), {}
            self._waiting.clear()
        for context in running:  # nobody can receive their answers now
            context.end()
        if not self._closing:
            log.error("the gRPC front process closed its service channel")
            self._on_lost()
        self._ended.set()

    def _take(self, message: tuple[str, int, Any, float | None]) -> _Call | None:
        """(Holding the read lock) handle a frame; a call this thread should run now is returned."""
        op, call_id, args, deadline = message
        if op == "cancel":
            with self._lock:
                context = self._calls.get(call_id)
            if context is not None:
                context.end()
            return None
        method, data, metadata = args
        if deadline is not None and time.monotonic() > deadline:
            reason = "the call's deadline passed before the replica started it"
            self._send(call_id, (False, (grpc.StatusCode.DEADLINE_EXCEEDED.name, reason)))
            return None
        call = _Call(call_id, method, data, FrameContext(metadata, deadline))
        with self._lock:
            self._calls[call_id] = call.context
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
        """Run the call and answer it (exactly once, whatever happens)."""
        reply: _Reply = (False, (grpc.StatusCode.INTERNAL.name, "the call ended without an answer"))
        try:
            reply = self._answer(call.method, call.data, call.context)
        finally:
            self._finish(call.call_id, call.context, reply)

    def _answer(self, method: str, data: bytes, context: FrameContext) -> _Reply:
        target = self._methods.get(method)
        if target is None:
            return False, (grpc.StatusCode.UNIMPLEMENTED.name, f"method {method} is not served over frames")
        try:
            request = target.request.FromString(data)
            # FrameContext provides the part of grpc.ServicerContext the servicer uses (see its doc)
            response = guard(target.fn)(request, cast(grpc.ServicerContext, context))
            return True, response.SerializeToString()
        except CallAborted as exc:
            return False, (exc.code.name, exc.details, exc.cause)
        except Exception as exc:  # outside guard: the request did not parse or the response not serialize
            log.exception("a forwarded call failed")
            return False, (grpc.StatusCode.INTERNAL.name, f"{type(exc).__name__}: {exc}")

    def _finish(self, call_id: int, context: FrameContext, reply: _Reply) -> None:
        with self._lock:
            self._calls.pop(call_id, None)
        self._send(call_id, reply)
        context.end()

    def _send(self, call_id: int, reply: _Reply) -> None:
        with contextlib.suppress(OSError):  # the front is gone; the reader sees EOF
            self.wire.send((call_id, *reply))
