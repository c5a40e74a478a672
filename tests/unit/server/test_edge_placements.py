"""The replica's one RPC path, exercised in both placements: the gRPC edge (`rpcs.Edge`) over
`LocalCore` (edge and core in one process) and over `RemoteCore` ⇄ `EngineLane` / `ServiceLane`
(the front process's socket pairs), the same `ReplicaCore` behind both, a fake engine in it.

Every assertion holds for both: results and typed statuses (with the peer cause), a call whose
deadline passed is not run, a prefill whose caller left is cleared, a service call's caller
cancelling or its deadline passing cancels its context and runs its after-answer work."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos import generate_pb2 as pb
from replica.config import ReplicaConfig
from replica.engine.types import (
    BatchId,
    CachedBatchInfo,
    DecodeInput,
    EngineInfo,
    FinishReason,
    GeneratedText,
    Generation,
    RequestId,
    StepResult,
    TokenList,
)
from replica.engine.worker import EngineWorker
from replica.errors import CAUSE_KEY, NotFound, PeerUnavailable
from replica.server import convert
from replica.server import messages as m
from replica.server.calls import CallContext
from replica.server.client import CoreClient
from replica.server.core import ReplicaCore
from replica.server.frames import BufferedFrameSocket, FrameSocket, ToFront, ToReplica
from replica.server.lanes import EngineLane, ServiceLane
from replica.server.local import LocalCore
from replica.server.remote import RemoteCore
from replica.server.rpcs import RPCS, Edge
from tests.helpers.eventually import eventually


def _step(batch: CachedBatchInfo | None = None) -> StepResult:
    tokens = TokenList(ids=(5,), logprobs=(-0.5,), texts=(" a",), is_special=(False,))
    done = GeneratedText("x a", 3, FinishReason.STOP_SEQUENCE, 7)
    full = Generation(RequestId(1), tokens, prefill_tokens=tokens, generated_text=done, top_tokens=(tokens,))
    two = TokenList(ids=(6, 7), logprobs=(-0.25, -1.0), texts=(" b", " c"), is_special=(False, True))
    return StepResult((full, Generation(RequestId(2), tokens), Generation(RequestId(3), two)), batch, 1, 2, 3)


class _FakeEngine:
    """Records calls; prefill blocks until released (to test a caller giving up mid-run)."""

    def __init__(self) -> None:
        self.store: set[BatchId] = set()
        self.decoded: list[DecodeInput] = []
        self.prefilled: list[BatchId] = []
        self.release = threading.Event()
        self.release.set()

    def decode(self, inputs: tuple[DecodeInput, ...]) -> StepResult:
        self.decoded = list(inputs)
        if inputs[0].batch_id == 404:
            raise NotFound("no batch 404")
        return _step(CachedBatchInfo(inputs[0].batch_id, (RequestId(1),), 8))

    def prefill(self, spec: Any, chunk_tokens: int = 0) -> StepResult:
        self.prefilled.append(spec.id)
        self.release.wait(5)
        self.store.add(spec.id)
        return _step(CachedBatchInfo(spec.id, (RequestId(1),), 8))

    def clear(self, batch_id: BatchId | None) -> None:
        self.store.discard(batch_id)

    def info(self) -> EngineInfo:
        return EngineInfo(
            model_id="fake", dtype="float32", device_type="cpu", num_layers=2, block_size=8,
            num_blocks_total=16, num_blocks_free=16 - len(self.store), embed_ready=True,
            num_layers_loaded=2, lm_head_ready=True, num_cached_batches=len(self.store),
            max_input_tokens=63, max_total_tokens=64, window_size=None,
        )


class _Service:
    """Service-lane handlers put into the core's table: Migrate waits until its caller is gone
    (recording what its context saw), Immigrate fails with the peer cause, Relay has a bug."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.after_ran = threading.Event()

    def migrate(self, call: m.Migrate, ctx: CallContext) -> CachedBatchInfo:
        ctx.after(self.after_ran.set)
        self.started.set()
        if ctx.cancellation.wait(ctx.remaining()):
            self.cancelled.set()
        raise PeerUnavailable("the caller left")

    @staticmethod
    def immigrate(call: m.Immigrate, ctx: CallContext) -> CachedBatchInfo:
        raise PeerUnavailable(f"rank {call.src[0]} is gone")

    @staticmethod
    def relay(call: m.Relay, ctx: CallContext) -> None:
        raise ZeroDivisionError("a bug")


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class _Context:
    """What the edge uses of grpc.ServicerContext; `end()` is grpc ending the RPC (callbacks run)."""

    def __init__(self, timeout: float | None = 5.0) -> None:
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.callbacks: list[Callable[[], None]] = []
        self.active = True
        self.trailing: tuple[tuple[str, str], ...] = ()

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        if not self.active:
            return False
        self.callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        return self.active

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    def end(self) -> None:
        self.active = False
        for callback in self.callbacks:
            callback()


@dataclass
class _Wired:
    edge: Edge
    engine: _FakeEngine
    service: _Service
    lost: threading.Event
    closers: list[Callable[[], None]] = field(default_factory=list)

    def call(self, rpc: str, request: Any, context: _Context | None = None) -> Any:
        """One RPC through the edge, as grpc runs it (its callbacks run once it returns)."""
        context = context or _Context()
        try:
            return self.edge.handler(RPCS[rpc])(request, context)
        finally:
            context.end()


def _core(worker: EngineWorker, engine: _FakeEngine, service: _Service) -> ReplicaCore:
    core = ReplicaCore(ReplicaConfig(model=Path("unused"), port=0), worker)
    core.shared.engine = engine  # type: ignore[assignment]
    core._service_calls[m.Migrate] = service.migrate
    core._service_calls[m.Immigrate] = service.immigrate
    core._service_calls[m.Relay] = service.relay
    return core


def _front(core: ReplicaCore, lost: threading.Event) -> tuple[CoreClient, list[Callable[[], None]]]:
    """RemoteCore in 'the front' and the lanes in 'the replica', over two socket pairs."""
    hot_a, hot_b = socket.socketpair()
    svc_a, svc_b = socket.socketpair()
    engine_lane = EngineLane(FrameSocket(hot_a, ToReplica), core.worker, core, lost.set)
    service_lane = ServiceLane(FrameSocket(svc_a, ToReplica), core, 4, lost.set)
    front_hot, front_service = BufferedFrameSocket(hot_b, ToFront), BufferedFrameSocket(svc_b, ToFront)
    client = RemoteCore(front_hot, front_service, lambda serving: None)
    readers = [threading.Thread(target=client.read_replies, args=(lane,), daemon=True) for lane in m.Lane]
    for thread in readers:
        thread.start()
    service_lane.start()
    engine_lane.start()

    def close() -> None:
        service_lane.expect_close()
        engine_lane.close()
        service_lane.close()
        for thread in readers:
            thread.join(5)

    return client, [close]


@pytest.fixture(params=["in-process", "front-process"])
def wired(request: pytest.FixtureRequest) -> Iterator[_Wired]:
    worker, engine, service, lost = EngineWorker("test-engine"), _FakeEngine(), _Service(), threading.Event()
    core = _core(worker, engine, service)
    client: CoreClient
    closers: list[Callable[[], None]] = []
    if request.param == "in-process":
        client = LocalCore(core)
    else:
        client, closers = _front(core, lost)
    wired = _Wired(Edge(client), engine, service, lost, closers)
    yield wired
    engine.release.set()
    for close in closers:
        close()
    worker.stop()


def _status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(_Aborted) as info:
        call()
    return info.value.code, info.value.details


def test_results_and_typed_errors(wired: _Wired) -> None:
    request = pb.DecodeV2Request(batches=[pb.CachedBatch(id=9)], last_iter_tokens=[pb.Tokens(ids=[4])])
    response = wired.call("DecodeV2", request)
    expected = pb.DecodeV2Response(total_ns=3)
    convert.fill_step(expected, _step(CachedBatchInfo(BatchId(9), (RequestId(1),), 8)))
    assert response == expected
    assert wired.engine.decoded == [DecodeInput(BatchId(9), (4,))]
    missing = pb.DecodeV2Request(batches=[pb.CachedBatch(id=404)])
    assert _status(lambda: wired.call("DecodeV2", missing)) == (grpc.StatusCode.NOT_FOUND, "no batch 404")


def test_statuses_carry_the_peer_cause_and_bugs_are_internal(wired: _Wired) -> None:
    context = _Context()
    request = pb.ImmigrateRequest(batch=pb.Batch(id=4), src=[3], dst=[0])
    assert _status(lambda: wired.call("Immigrate", request, context)) == (
        grpc.StatusCode.UNAVAILABLE,
        "rank 3 is gone",
    )
    assert context.trailing == ((CAUSE_KEY, "peer"),)
    bug = pb.RelayRequest()
    assert _status(lambda: wired.call("Relay", bug)) == (grpc.StatusCode.INTERNAL, "ZeroDivisionError: a bug")


def test_a_call_whose_deadline_passed_is_not_run(wired: _Wired) -> None:
    request = pb.PrefillV2Request(batch=pb.Batch(id=8, requests=[pb.Request(id=1, input_tokens=[1])]))
    code, _ = _status(lambda: wired.call("PrefillV2", request, _Context(timeout=0.0)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # a call after it on the same path: whatever of the first reached the engine has run by its answer
    missing = pb.DecodeV2Request(batches=[pb.CachedBatch(id=404)])
    assert _status(lambda: wired.call("DecodeV2", missing))[0] == grpc.StatusCode.NOT_FOUND
    assert wired.engine.prefilled == [] and wired.engine.store == set()


def test_a_prefill_whose_caller_gave_up_is_cleared(wired: _Wired) -> None:
    wired.engine.release.clear()
    request = pb.PrefillV2Request(batch=pb.Batch(id=7, requests=[pb.Request(id=1, input_tokens=[1])]))
    code, _ = _status(lambda: wired.call("PrefillV2", request, _Context(timeout=0.2)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wired.engine.prefilled == [7]  # it was running when its caller left
    wired.engine.release.set()
    eventually(lambda: wired.engine.store == set())  # cached after the caller left, then cleared


def test_a_prefill_whose_caller_cancelled_is_cleared(wired: _Wired) -> None:
    wired.engine.release.clear()
    context = _Context(timeout=None)
    request = pb.PrefillV2Request(batch=pb.Batch(id=6, requests=[pb.Request(id=1, input_tokens=[1])]))
    handler = wired.edge.handler(RPCS["PrefillV2"])
    thread = threading.Thread(target=lambda: handler(request, context), daemon=True)
    thread.start()
    eventually(lambda: wired.engine.prefilled == [6])
    context.end()  # the client cancelled while the engine ran the prefill
    wired.engine.release.set()
    thread.join(5)
    eventually(lambda: wired.engine.store == set())


def test_info_answers_while_the_engine_thread_runs_a_long_prefill(wired: _Wired) -> None:
    """The router polls Info for liveness: a prefill longer than its heartbeat deadline must not
    make a busy replica look dead."""
    wired.engine.release.clear()
    request = pb.PrefillV2Request(batch=pb.Batch(id=5, requests=[pb.Request(id=1, input_tokens=[1])]))
    handler = wired.edge.handler(RPCS["PrefillV2"])
    thread = threading.Thread(target=lambda: handler(request, _Context(timeout=None)), daemon=True)
    thread.start()
    eventually(lambda: wired.engine.prefilled == [5])  # the engine thread is inside the prefill
    info = wired.call("Info", pb.InfoRequest(), _Context(timeout=1.0))
    assert info.num_blocks_free == 16 and info.num_cached_batches == 0
    wired.engine.release.set()
    thread.join(5)
    assert wired.call("Info", pb.InfoRequest()).num_cached_batches == 1


def _migrate_in_background(wired: _Wired, context: _Context) -> list[BaseException]:
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            wired.edge.handler(RPCS["Migrate"])(pb.MigrateRequest(dst=[1]), context)
        except _Aborted as exc:
            outcome.append(exc)

    threading.Thread(target=run, daemon=True).start()
    return outcome


def test_a_cancelled_caller_cancels_the_service_call(wired: _Wired) -> None:
    context = _Context(timeout=None)
    outcome = _migrate_in_background(wired, context)
    assert wired.service.started.wait(5)
    context.end()  # the client cancelled: grpc runs the edge's callbacks
    assert wired.service.cancelled.wait(5)
    assert wired.service.after_ran.wait(5)
    eventually(lambda: len(outcome) == 1)


def test_a_passed_deadline_ends_the_service_call_in_time(wired: _Wired) -> None:
    start = time.monotonic()
    code, _ = _status(lambda: wired.call("Migrate", pb.MigrateRequest(dst=[1]), _Context(timeout=0.3)))
    assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    assert time.monotonic() - start < 2.0
    assert wired.service.after_ran.wait(5)
    assert wired.call("Health", pb.HealthRequest()).state == "loading"  # still serving


def test_front_process_closing_fails_waiting_calls_and_a_dying_front_is_reported() -> None:
    worker, engine, service, lost = EngineWorker("test-engine"), _FakeEngine(), _Service(), threading.Event()
    core = _core(worker, engine, service)
    client, (close,) = _front(core, lost)
    edge = Edge(client)
    context = _Context(timeout=None)
    wired = _Wired(edge, engine, service, lost)
    outcome = _migrate_in_background(wired, context)
    assert service.started.wait(5)
    close()  # the replica stops its front: the running call's context is cancelled, the caller fails
    assert service.cancelled.wait(5)
    eventually(lambda: len(outcome) == 1)
    assert isinstance(outcome[0], _Aborted) and outcome[0].code == grpc.StatusCode.UNAVAILABLE
    assert _status(lambda: wired.call("Health", pb.HealthRequest()))[0] == grpc.StatusCode.UNAVAILABLE
    assert not lost.is_set()
    worker.stop()

    worker = EngineWorker("test-engine")
    core = _core(worker, _FakeEngine(), _Service())
    a, b = socket.socketpair()
    lane = ServiceLane(FrameSocket(a, ToReplica), core, 1, lost.set)
    lane.start()
    b.close()  # the front died
    assert lost.wait(5)
    lane.close()
    worker.stop()


def test_published_health_reaches_the_front() -> None:
    seen: list[bool] = []
    a, b = socket.socketpair()
    worker = EngineWorker("test-engine")
    lane = ServiceLane(FrameSocket(a, ToReplica), _core(worker, _FakeEngine(), _Service()), 1, lambda: None)
    hot_a, hot_b = socket.socketpair()
    client = RemoteCore(BufferedFrameSocket(hot_b, ToFront), BufferedFrameSocket(b, ToFront), seen.append)
    reader = threading.Thread(target=client.read_replies, args=(m.Lane.SERVICE,), daemon=True)
    reader.start()
    lane.publish(True)
    eventually(lambda: seen == [True])
    lane.close()
    reader.join(5)
    hot_a.close()
    worker.stop()
