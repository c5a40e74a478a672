"""`ServiceChannel`: the replica's end of the front process's second socket pair, the service channel.

Every TextGenerationService unary call that is not hot (Migrate, Immigrate, the partial halves,
PrefillV2's weight / migration cases, LoadParams, Send/RecvParams, broadcasts, ZagPrefill, Relay,
Health, Info, Warmup, ...) arrives here as its serialized request instead of over a second gRPC
hop. A reader thread of its own takes the frames — never the engine thread, which may be inside a
long item (a zigzag or layer-waiting prefill, a progressive migration) that only such a call can
unblock — and hands each call to a thread pool, where `ReplicaServicer`'s method runs behind the
same `interceptor.guard` as on the gRPC server, with a `FrameContext` in place of
`grpc.ServicerContext`. Decode steps never wake this reader.

```
 front ──("rpc", id, (method, request bytes, metadata), deadline)──► reader thread ─► pool thread
       ──("cancel", id, None, None)──► the call's context ends: is_active() False, callbacks run
       ◄── (id, True, response bytes) | (id, False, (grpc code name, details)) ── pool thread, once
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import grpc
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from protos import generate_pb2 as pb
from replica.server.interceptor import guard
from replica.server.wire import FrameSocket

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["TextGenerationService"]

Metadata = tuple[tuple[str, str | bytes], ...]


class CallAborted(Exception):
    """Raised by `FrameContext.abort`, like grpc's own abort: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class FrameContext:
    """What `ReplicaServicer` and its helpers use of `grpc.ServicerContext`, for a call over frames.

    - `time_remaining()`: seconds to the call's deadline (None without one; grpc reports a huge
      number there, which the servicer's helpers also read as "none").
    - `is_active()`: False once the caller cancelled, the deadline passed or the call ended.
    - `invocation_metadata()`: the caller's metadata as the front passed it on.
    - `add_callback(fn)`: `fn` runs once when the call ends (answered, cancelled, or the replica
      closes the channel); False if it already ended.
    - `abort(code, details)`: raises `CallAborted` (grpc's abort raises too); the call ends with it.
    """

    def __init__(self, metadata: Sequence[tuple[str, str | bytes]], deadline: float | None) -> None:
        self._metadata: Metadata = tuple((str(k), v) for k, v in metadata)
        self._deadline = deadline  # time.monotonic() value
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []  # None once the call ended

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

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """End the call with `code` and `details` (raises `CallAborted`)."""
        raise CallAborted(code, details)

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


# (ok, response bytes) or (not ok, (grpc code name, details))
_Reply = tuple[bool, Any]


class ServiceChannel:
    """Serves the front's forwarded calls: one reader thread, a pool running the servicer's methods."""

    def __init__(
        self,
        wire: FrameSocket,
        servicer: object,
        workers: int,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self.wire = wire
        self._methods = unary_methods(servicer)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="service")
        self._on_lost = on_lost  # called when the front process went away unexpectedly
        self._closing = False
        self._calls: dict[int, FrameContext] = {}  # running calls, for "cancel"
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="service-reader", daemon=True)

    def start(self) -> None:
        """Start reading calls."""
        self._reader.start()

    def expect_close(self) -> None:
        """The replica is stopping its front: its end of the channel closing is not a loss."""
        self._closing = True

    def close(self) -> None:
        """Shut the socket, end every running call (their callbacks run), then close it."""
        self._closing = True
        self.wire.shutdown()
        self._reader.join(10.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.wire.close()

    def _read(self) -> None:
        while (message := self.wire.recv()) is not None:
            try:
                self._take(message)
            except Exception:
                log.exception("a frame of the service channel could not be handled")
        with self._lock:
            running, self._calls = list(self._calls.values()), {}
        for context in running:  # nobody can receive their answers now
            context.end()
        if not self._closing:
            log.error("the gRPC front process closed its service channel")
            self._on_lost()

    def _take(self, message: tuple[str, int, Any, float | None]) -> None:
        op, call_id, args, deadline = message
        if op == "cancel":
            with self._lock:
                context = self._calls.get(call_id)
            if context is not None:
                context.end()
            return
        method, data, metadata = args
        if deadline is not None and time.monotonic() > deadline:
            reason = "the call's deadline passed before the replica started it"
            self._send(call_id, (False, (grpc.StatusCode.DEADLINE_EXCEEDED.name, reason)))
            return
        context = FrameContext(metadata, deadline)
        with self._lock:
            self._calls[call_id] = context
        try:
            self._pool.submit(self._serve, call_id, method, data, context)
        except RuntimeError:  # the pool is shut down: the replica is closing
            closing = (grpc.StatusCode.UNAVAILABLE.name, "the replica is shutting down")
            self._finish(call_id, context, (False, closing))

    def _serve(self, call_id: int, method: str, data: bytes, context: FrameContext) -> None:
        """On a pool thread: run the call and answer it (exactly once, whatever happens)."""
        reply: _Reply = (False, (grpc.StatusCode.INTERNAL.name, "the call ended without an answer"))
        try:
            reply = self._answer(method, data, context)
        finally:
            self._finish(call_id, context, reply)

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
            return False, (exc.code.name, exc.details)
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
