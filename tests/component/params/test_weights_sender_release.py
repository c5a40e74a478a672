"""A weight sender lets go of the parameter guard as soon as its peer is known gone or its caller
cancelled, not when the fabric's refused-connection grace (REFUSED_GRACE_S, 15 s) or the transfer
deadline runs out.

- The receiver died after it had sent this replica its weights (a connection from it was seen
  closing): SendParams to it fails at once, WaitRdmaDone says UNAVAILABLE, the guard is free.
- A blocking NvlBroadcast whose other member never joins, cancelled by its caller: the transfer is
  aborted and the guard is free at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from protos import generate_pb2 as pb
from tests.helpers.weights_cluster import CALL_TIMEOUT, weights_cluster

TRANSFER_TIMEOUT = 20.0


def _wait_for(condition: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_sender_to_a_receiver_known_gone_releases_the_guard_at_once(
    tiny_llama: Path, tmp_path: Path
) -> None:
    with weights_cluster(tiny_llama, tmp_path, 2, inactive=[1], transfer_timeout=TRANSFER_TIMEOUT) as (a, b):
        b.stub.RecvParams(pb.RecvParamsRequest(src=0), timeout=CALL_TIMEOUT)  # a → b first
        a.stub.SendParams(pb.SendParamsRequest(dst=1), timeout=CALL_TIMEOUT)
        for replica in (a, b):
            replica.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)
        a.services.stop()  # the first sender dies; b saw its connection close
        time.sleep(0.2)

        start = time.monotonic()
        b.stub.SendParams(pb.SendParamsRequest(dst=0), timeout=CALL_TIMEOUT)
        with pytest.raises(grpc.RpcError) as failed:
            b.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 3.0  # not REFUSED_GRACE_S
        assert not b.weights.ops.busy


def test_a_cancelled_blocking_broadcast_releases_the_guard_at_once(tiny_llama: Path, tmp_path: Path) -> None:
    with weights_cluster(tiny_llama, tmp_path, 2, inactive=[1], transfer_timeout=TRANSFER_TIMEOUT) as (a, _):
        request = pb.BroadcastRequest(src_ranks=[0], dst_ranks=[1])  # rank 1 never joins
        call = a.stub.NvlBroadcast.future(request, timeout=CALL_TIMEOUT)
        _wait_for(lambda: a.weights.ops.busy, timeout=5.0)
        time.sleep(0.3)
        call.cancel()
        assert _wait_for(lambda: not a.weights.ops.busy, timeout=3.0) < 3.0
        a.stub.ResetStatus(pb.ResetStatusRequest(), timeout=CALL_TIMEOUT)  # the guard takes a new operation
