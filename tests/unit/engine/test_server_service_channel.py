"""The service channel between the front process and the replica (`Backend.rpc` ↔ `ServiceChannel`):
responses and statuses pass through as the servicer's interceptor mapping gives them, metadata
arrives, a passed deadline does not run the call, and a call whose caller gave up (cancel or
deadline) ends the servicer's context: `is_active()` turns False and its callbacks run."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import grpc
import pytest

from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from replica.errors import AlreadyExists, DeadlineExceeded, ReplicaError, ShuttingDown
from replica.server.frontend import SERVICE, Backend, ForwardedError
from replica.server.service_channel import FrameContext, ServiceChannel
from replica.server.wire import FrameSocket


class _Servicer(pb_grpc.TextGenerationServiceServicer):
    """Info answers with the caller's metadata; Immigrate raises AlreadyExists; Migrate blocks until
    its call ends (recording the context as its end callback saw it); Relay raises a bug."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.active_at_end: bool | None = None
        self.started = threading.Event()
        self.ran = threading.Event()

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        self.ran.set()
        metadata = dict(context.invocation_metadata())
        return pb.InfoResponse(model_id=str(metadata.get("x-who")), num_blocks_free=7)

    def Immigrate(self, request: pb.ImmigrateRequest, context: grpc.ServicerContext) -> pb.ImmigrateResponse:
        raise AlreadyExists(f"batch {request.batch.id} is already cached")

    def Migrate(self, request: pb.MigrateRequest, context: grpc.ServicerContext) -> pb.MigrateResponse:
        def on_end() -> None:
            self.active_at_end = context.is_active()
            self.ended.set()

        assert context.add_callback(on_end)
        self.started.set()
        self.ended.wait(10)
        return pb.MigrateResponse()

    def Relay(self, request: pb.RelayRequest, context: grpc.ServicerContext) -> pb.RelayResponse:
        raise ZeroDivisionError("a bug")


def _caller(metadata: tuple[tuple[str, str], ...] = ()) -> FrameContext:
    """The front's caller context: `FrameContext` has the grpc.ServicerContext behaviour `Backend.rpc`
    relies on (metadata; `add_callback` refused once the RPC ended, which can happen before the call
    registers it; `end()` = the RPC ended, callbacks run once)."""
    return FrameContext(metadata, None)


@dataclass
class _Wired:
    backend: Backend
    servicer: _Servicer
    channel: ServiceChannel
    lost: threading.Event

    def call(
        self, method: str, request: bytes, context: FrameContext | None = None, timeout: float | None = 5.0
    ) -> bytes:
        caller = context or _caller()
        return self.backend.rpc(f"/{SERVICE}/{method}", request, cast(grpc.ServicerContext, caller), timeout)


@pytest.fixture
def wired() -> Iterator[_Wired]:
    a, b = socket.socketpair()
    servicer, lost = _Servicer(), threading.Event()
    channel = ServiceChannel(FrameSocket(a), servicer, workers=4, on_lost=lost.set)
    channel.start()
    backend = Backend(FrameSocket(b))
    reader = threading.Thread(target=backend.read_replies, daemon=True)
    reader.start()
    yield _Wired(backend, servicer, channel, lost)
    servicer.ended.set()
    channel.close()
    reader.join(5)


def _status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ForwardedError) as info:
        call()
    return info.value.grpc_code, str(info.value)


def test_response_and_metadata(wired: _Wired) -> None:
    data = wired.call("Info", pb.InfoRequest().SerializeToString(), _caller((("x-who", "me"),)))
    assert pb.InfoResponse.FromString(data) == pb.InfoResponse(model_id="me", num_blocks_free=7)


def test_statuses_are_the_interceptors(wired: _Wired) -> None:
    request = pb.ImmigrateRequest(batch=pb.Batch(id=4)).SerializeToString()
    assert _status(lambda: wired.call("Immigrate", request)) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "batch 4 is already cached",
    )
    bug = pb.RelayRequest().SerializeToString()
    assert _status(lambda: wired.call("Relay", bug)) == (grpc.StatusCode.INTERNAL, "ZeroDivisionError: a bug")
    code, _ = _status(lambda: wired.call("NoSuchMethod", b""))
    assert code == grpc.StatusCode.UNIMPLEMENTED


def test_a_passed_deadline_does_not_run_the_call(wired: _Wired) -> None:
    # the deadline passed on the way (the front itself waits at most until the deadline)
    _, slot = wired.backend.send("rpc", (f"/{SERVICE}/Info", b"", []), -1.0)
    assert slot.wait(5) and slot.reply is not None
    ok, (code, _) = slot.reply
    assert (ok, code) == (False, grpc.StatusCode.DEADLINE_EXCEEDED.name)
    assert not wired.servicer.ran.is_set()


def test_a_deadline_ends_the_servicers_call(wired: _Wired) -> None:
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        wired.call("Migrate", pb.MigrateRequest().SerializeToString(), timeout=0.3)
    assert time.monotonic() - start < 2.0
    assert wired.servicer.ended.wait(5) and wired.servicer.active_at_end is False
    # the late reply is dropped; the channel keeps serving
    assert pb.InfoResponse.FromString(wired.call("Info", b"")).num_blocks_free == 7


def test_a_cancelled_call_runs_the_servicers_callbacks(wired: _Wired) -> None:
    caller = _caller()
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            wired.call("Migrate", pb.MigrateRequest().SerializeToString(), caller, timeout=None)
        except ReplicaError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    assert wired.servicer.started.wait(5)
    caller.end()  # the client cancelled: grpc runs the front's callbacks
    assert wired.servicer.ended.wait(5) and wired.servicer.active_at_end is False
    thread.join(5)
    assert len(outcome) == 1


def test_a_closing_replica_fails_waiting_calls_and_a_dying_front_is_reported(wired: _Wired) -> None:
    results: list[BaseException] = []

    def call() -> None:
        try:
            wired.call("Migrate", pb.MigrateRequest().SerializeToString(), timeout=None)
        except ReplicaError as exc:
            results.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    assert wired.servicer.started.wait(5)
    wired.channel.close()  # the replica stops: the running call's context ends, the front's call fails
    thread.join(5)
    assert wired.servicer.ended.is_set() and not wired.lost.is_set()
    assert len(results) == 1 and isinstance(results[0], ForwardedError)
    assert results[0].grpc_code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ShuttingDown):
        wired.call("Info", b"")


def test_front_gone_calls_on_lost() -> None:
    a, b = socket.socketpair()
    lost = threading.Event()
    channel = ServiceChannel(FrameSocket(a), _Servicer(), workers=1, on_lost=lost.set)
    channel.start()
    FrameSocket(b).close()
    assert lost.wait(5)
    channel.close()


def test_frame_context() -> None:
    context = FrameContext([("k", "v")], time.monotonic() + 60)
    remaining = context.time_remaining()
    assert remaining is not None and 0 < remaining <= 60
    assert context.is_active() and context.invocation_metadata() == (("k", "v"),)
    ran: list[int] = []
    assert context.add_callback(lambda: ran.append(1))
    with pytest.raises(Exception) as info:
        context.abort(grpc.StatusCode.NOT_FOUND, "gone")
    assert (getattr(info.value, "code", None), getattr(info.value, "details", None)) == (
        grpc.StatusCode.NOT_FOUND,
        "gone",
    )
    context.end()
    context.end()
    assert ran == [1] and not context.is_active() and not context.add_callback(lambda: None)
    assert FrameContext([], None).time_remaining() is None
    assert not FrameContext([], time.monotonic() - 1).is_active()
