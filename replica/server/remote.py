"""`RemoteCore`: the edge in the gRPC front process calling the core in the replica process.

```
 gRPC thread: start(call) ── Request ──► hot socket (ENGINE calls) or service socket (SERVICE calls)
 reader thread per socket: Reply ──► deliver to the waiting call (its value still encoded)
 gRPC thread: wait() ── decodes the value into the call's reply type
 caller gone ── Cancel ──► service socket (a SERVICE call's context is cancelled in the replica)
```
An ENGINE call needs no Cancel: the replica runs it as soon as the engine thread reads it (a call
read after its deadline is answered DEADLINE_EXCEEDED unrun), and a result nobody takes goes to
the call's `orphan` here. When the replica closes a socket, the calls waiting on it fail
UNAVAILABLE and new ones are refused.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any, cast

import msgspec

from replica.errors import ReplicaError, ShuttingDown, Status
from replica.server.client import CoreClient, Pending
from replica.server.frames import Cancel, Failure, FrameSocket, Request, Serving
from replica.server.messages import AnyCall, Call, Lane

log = logging.getLogger(__name__)


class RemoteError(ReplicaError):
    """A ReplicaError raised in the replica process (its status, message and cause)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.status = Status(failure.status)
        self.cause = failure.cause


class RemoteCore(CoreClient):
    """Calls the core of the replica process over the hot and the service socket."""

    def __init__(self, hot: FrameSocket, service: FrameSocket, on_serving: Callable[[bool], None]) -> None:
        super().__init__()
        self._wires = {Lane.ENGINE: hot, Lane.SERVICE: service}
        self._on_serving = on_serving
        self._ids = itertools.count(1)
        self._slots: dict[Lane, dict[int, Pending]] = {Lane.ENGINE: {}, Lane.SERVICE: {}}
        self._closed: set[Lane] = set()
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}

    def start(self, call: Call, deadline: float | None) -> Pending:
        lane = call.lane
        call_id = next(self._ids)
        pending = Pending(call, call_id)
        with self._lock:
            if lane in self._closed:
                raise ShuttingDown("the replica closed the connection")
            self._slots[lane][call_id] = pending
        try:
            self._wires[lane].send(Request(call_id, deadline, cast(AnyCall, call)))
        except BaseException as exc:
            with self._lock:
                self._slots[lane].pop(call_id, None)
            if isinstance(exc, OSError):
                raise ShuttingDown("the replica closed the connection") from None
            raise
        return pending

    def _abandon(self, pending: Pending) -> None:
        if pending.call.lane is Lane.SERVICE:
            with contextlib.suppress(OSError):  # the replica is gone: nothing runs there any more
                self._wires[Lane.SERVICE].send(Cancel(pending.handle))

    def _value(self, pending: Pending, value: Any) -> Any:
        reply_type = type(pending.call).reply
        decoder = self._decoders.get(reply_type)
        if decoder is None:
            decoder = self._decoders[reply_type] = msgspec.msgpack.Decoder(reply_type)
        return decoder.decode(value)

    def read_replies(self, lane: Lane) -> None:
        """Deliver the replies of `lane` until the replica closes its socket; then fail what waits."""
        wire, slots = self._wires[lane], self._slots[lane]
        while (message := self._next(wire)) is not None:
            if isinstance(message, Serving):
                self._on_serving(message.serving)
                continue
            with self._lock:
                pending = slots.pop(message.call_id, None)
            if pending is None:
                continue
            if message.failure is None:
                self.deliver(pending, True, message.value)
            else:
                self.deliver(pending, False, RemoteError(message.failure))
        with self._lock:
            self._closed.add(lane)
            waiting, self._slots[lane] = list(slots.values()), {}
        self.fail_all(waiting, ShuttingDown("the replica closed the connection"))

    @staticmethod
    def _next(wire: FrameSocket) -> Any:
        """The next frame (None at EOF); one that does not decode is dropped (its call then ends at
        its deadline) rather than ending the reader and with it every call."""
        while True:
            try:
                return wire.recv()
            except msgspec.DecodeError:
                log.exception("a frame from the replica could not be decoded")
