"""Parameter readiness (prefix counting, waits, listeners), the one-operation guard, chain derivation."""

from __future__ import annotations

import threading
import time

import pytest

from replica.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, PeerUnavailable
from replica.model.layout import RegionKind
from replica.params.operations import OpState, ParamOps
from replica.params.readiness import ParamReadiness, Readiness
from replica.params.transfer import chain_of


def test_layers_count_the_contiguous_prefix() -> None:
    ready = ParamReadiness(4, loaded=False)
    assert ready.snapshot() == Readiness(False, 0, False, 4) and ready.snapshot().empty
    ready.mark(RegionKind.LAYER, 1)  # out of order (Tanz): layer 0 still missing
    ready.mark(RegionKind.LAYER, 3)
    assert ready.snapshot().layers == 0
    ready.mark(RegionKind.LAYER, 0)
    assert ready.snapshot().layers == 2
    ready.mark(RegionKind.EMBED)
    ready.mark(RegionKind.LAYER, 2)
    assert not ready.snapshot().complete
    with pytest.raises(FailedPrecondition, match="4/4 layers, head=False"):
        ready.require_complete("a NORMAL prefill")
    ready.mark(RegionKind.HEAD)
    assert ready.complete
    ready.reset()
    assert ready.snapshot().empty
    with pytest.raises(ValueError):
        ready.mark(RegionKind.LAYER, 4)


def test_wait_layer_wakes_on_arrival_and_times_out() -> None:
    ready = ParamReadiness(2, loaded=False)
    seen: list[int] = []
    ready.subscribe(lambda state: seen.append(state.layers))
    with pytest.raises(DeadlineExceeded):
        ready.wait_layer(0, 0.01)
    def arrive() -> None:
        ready.mark(RegionKind.EMBED)
        ready.mark(RegionKind.LAYER, 0)

    threading.Timer(0.05, arrive).start()
    ready.wait_layer(0, 5.0)
    assert seen == [0, 1]


def test_guard_background_then_wait_returns_its_error() -> None:
    ops = ParamOps()
    with pytest.raises(FailedPrecondition, match="no background"):
        ops.wait(0.1)
    release = threading.Event()

    def transfer() -> None:
        release.wait(5)
        raise PeerUnavailable("rank 3 went away")

    ops.start_background("RdmaBroadcast", lambda: None, transfer)
    assert ops.state.value == OpState.BACKGROUND.value
    with pytest.raises(FailedPrecondition, match="RdmaBroadcast"):
        ops.run_blocking("LoadParams", lambda: None)
    with pytest.raises(DeadlineExceeded):
        ops.wait(0.01)  # still running: the guard stays held
    release.set()
    with pytest.raises(PeerUnavailable, match="rank 3"):
        ops.wait(5)
    assert not ops.busy
    ops.run_blocking("LoadParams", lambda: None)


def test_guard_released_when_prepare_refuses() -> None:
    ops = ParamOps()

    def refuse() -> None:
        raise FailedPrecondition("not loaded")

    with pytest.raises(FailedPrecondition, match="not loaded"):
        ops.start_background("SendParams", refuse, lambda: time.sleep(10))
    assert not ops.busy


def test_chain_of_tensor_parallel_ranks() -> None:
    assert chain_of([0], [3, 1, 2]) == [0, 3, 1, 2]
    assert chain_of([0, 1], [4, 5, 6, 7], tp_rank=1) == [1, 5, 7]
    with pytest.raises(InvalidArgument):
        chain_of([0, 1], [4, 5, 6])
    with pytest.raises(InvalidArgument):
        chain_of([], [1])
