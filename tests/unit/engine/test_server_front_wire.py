"""The front process's wire: step results survive the trip; HotPath + Backend over a socket pair
deliver results and typed errors, and a prefill whose caller gave up leaves no batch behind."""

from __future__ import annotations

import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from protos import generate_pb2 as pb
from replica.engine.types import (
    BatchId,
    CachedBatchInfo,
    DecodeInput,
    FinishReason,
    GeneratedText,
    Generation,
    RequestId,
    StepResult,
    TokenList,
)
from replica.engine.worker import EngineWorker
from replica.errors import DeadlineExceeded, NotFound, Status
from replica.server import convert
from replica.server.frontend import Backend, RemoteError
from replica.server.hotpath import HotPath
from replica.server.wire import BufferedFrameSocket, FrameSocket, decode_step, encode_step


def _step(batch: CachedBatchInfo | None = None) -> StepResult:
    tokens = TokenList(ids=(5,), logprobs=(-0.5,), texts=(" a",), is_special=(False,))
    done = GeneratedText("x a", 3, FinishReason.STOP_SEQUENCE, 7)
    full = Generation(RequestId(1), tokens, prefill_tokens=tokens, generated_text=done, top_tokens=(tokens,))
    two = TokenList(ids=(6, 7), logprobs=(-0.25, -1.0), texts=(" b", " c"), is_special=(False, True))
    generations = (full, Generation(RequestId(2), tokens), Generation(RequestId(3), two))
    return StepResult(generations, batch, 1, 2, 3, 4)


def test_step_round_trip_and_frames() -> None:
    result = _step(CachedBatchInfo(BatchId(3), (RequestId(1), RequestId(2)), 64))
    assert decode_step(encode_step(result)) == result
    for batch in (result.batch, None):
        step = StepResult(result.generations, batch)
        direct, from_wire = pb.DecodeV2Response(), pb.DecodeV2Response()
        convert.fill_step(direct, step)
        convert.fill_encoded_step(from_wire, encode_step(step))
        assert from_wire == direct
    a, b = socket.socketpair()
    left, right = FrameSocket(a), FrameSocket(b)
    left.send(("decode", 1, [DecodeInput(BatchId(3), (4, 5))], None))
    assert right.recv() == ("decode", 1, [DecodeInput(BatchId(3), (4, 5))], None)
    left.close()
    assert right.recv() is None
    right.close()


def test_buffered_reader_slices_frames_out_of_partial_and_large_reads() -> None:
    a, b = socket.socketpair()
    writer, reader = FrameSocket(a), BufferedFrameSocket(b, capacity=64)
    messages = [("small", i) for i in range(5)] + [b"x" * 1000, ("after", "large"), b"y" * 50, b"z" * 70]
    frames = b"".join(_frame(m) for m in messages)
    received: list[Any] = []
    thread = threading.Thread(target=lambda: received.extend(reader.recv() for _ in messages))
    thread.start()
    for cut in range(0, len(frames), 7):  # dribbled out: frames split across reads anywhere
        a.sendall(frames[cut : cut + 7])
        time.sleep(0.0005)
    thread.join(5)
    assert received == messages
    writer.send(("one", "more"))
    assert reader.recv() == ("one", "more")
    a.sendall(_frame(b"w" * 200)[:100])  # the peer leaves in the middle of a frame
    writer.close()
    assert reader.recv() is None
    reader.close()


def _frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "little") + data


class _Context:
    """The part of grpc.ServicerContext that Backend.wait uses."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True


class _Store(set[BatchId]):
    pass


class _FakeEngine:
    """Records calls; prefill blocks until released (to test a caller giving up mid-run)."""

    def __init__(self) -> None:
        self.store = _Store()
        self.decoded: list[DecodeInput] = []
        self.release = threading.Event()
        self.release.set()

    def decode(self, inputs: list[DecodeInput]) -> StepResult:
        self.decoded = inputs
        if inputs[0].batch_id == 404:
            raise NotFound("no batch 404")
        return _step(CachedBatchInfo(inputs[0].batch_id, (RequestId(1),), 8))

    def prefill(self, spec: Any) -> StepResult:
        self.release.wait(5)
        self.store.add(BatchId(spec))
        return _step(CachedBatchInfo(BatchId(spec), (RequestId(1),), 8))

    def clear(self, batch_id: BatchId | None) -> None:
        self.store.discard(batch_id)


@pytest.fixture
def wired() -> Iterator[tuple[Backend, _FakeEngine]]:
    worker, engine = EngineWorker("test-engine"), _FakeEngine()
    a, b = socket.socketpair()
    hot = HotPath(FrameSocket(a), worker, lambda: engine)  # type: ignore[arg-type, return-value]
    hot.start()
    backend = Backend(BufferedFrameSocket(b))
    reader = threading.Thread(target=backend.read_replies, daemon=True)
    reader.start()
    yield backend, engine
    hot.close()
    reader.join(5)
    worker.stop()


def test_expired_call_does_not_run(wired: tuple[Backend, _FakeEngine]) -> None:
    backend, engine = wired
    with pytest.raises(RemoteError) as info:
        backend.wait(backend.send("prefill", 8, -1.0), _Context(), 5)
    assert info.value.status == Status.DEADLINE_EXCEEDED
    assert engine.store == set()


def test_results_and_typed_errors(wired: tuple[Backend, _FakeEngine]) -> None:
    backend, engine = wired
    payload = backend.wait(backend.send("decode", [(9, ())], 5), _Context(), 5)
    assert decode_step(payload).batch == CachedBatchInfo(BatchId(9), (RequestId(1),), 8)
    assert engine.decoded == [DecodeInput(BatchId(9))]
    with pytest.raises(RemoteError) as info:
        backend.wait(backend.send("decode", [(404, (4,))], 5), _Context(), 5)
    assert info.value.status == Status.NOT_FOUND


def test_prefill_whose_caller_gave_up_is_dropped(wired: tuple[Backend, _FakeEngine]) -> None:
    backend, engine = wired
    engine.release.clear()
    with pytest.raises(DeadlineExceeded):
        backend.wait(backend.send("prefill", 7, 5), _Context(), 0.05)
    engine.release.set()
    # the batch was cached after the caller left: the front clears it (a call behind it on the wire)
    limit = time.monotonic() + 5
    while engine.store != set() and time.monotonic() < limit:
        time.sleep(0.01)
    assert engine.store == set()
