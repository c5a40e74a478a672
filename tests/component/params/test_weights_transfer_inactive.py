"""An inactive replica receives its weights (p2p, chain multicast, Tanz) and then generates exactly
what transformers generates; readiness, Health and the parameter-operation guard along the way."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from protos import generate_pb2 as pb
from tests.helpers.weights_cluster import (
    CALL_TIMEOUT,
    InProcReplica,
    generate,
    make_batch,
    prompts_for,
    reference,
    weights_cluster,
)
from transfer.collectives import TransferOptions

MAX_NEW = 6


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=3)


@pytest.fixture(scope="module")
def expected(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = prompts_for(512)
    return prompts, reference(model, prompts, MAX_NEW)


def _all(calls: list[Callable[[], object]]) -> list[object]:
    """Run blocking calls concurrently (each on its thread); re-raise the first failure."""
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CALL_TIMEOUT)
    if errors:
        raise errors[0]
    return results


def _check_serves_like_transformers(
    replicas: list[InProcReplica], source: InProcReplica, expected: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, want = expected
    for i, replica in enumerate(replicas):
        assert replica.health() == "serving"
        info = replica.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)
        assert (info.embed_ready, info.num_layers_loaded, info.lm_head_ready) == (True, 3, True)
        assert torch.equal(replica.weights.params.buffer, source.weights.params.buffer)
        free = replica.free_blocks()
        assert generate(replica.stub, 10 + i, prompts, MAX_NEW) == want
        assert replica.free_blocks() == free


def test_p2p_to_inactive_replica(model: Path, expected: tuple, tmp_path: Path) -> None:
    with weights_cluster(model, tmp_path, 2, inactive=[1]) as (src, dst):
        assert dst.health() == "inactive"
        info = dst.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)
        assert (info.embed_ready, info.num_layers_loaded, info.lm_head_ready) == (False, 0, False)
        with pytest.raises(grpc.RpcError) as refused:
            dst.stub.PrefillV2(pb.PrefillV2Request(batch=make_batch(1, [[5, 6]], 2)), timeout=CALL_TIMEOUT)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as nothing:
            dst.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)
        assert nothing.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        dst.stub.RecvParams(pb.RecvParamsRequest(src=0), timeout=CALL_TIMEOUT)  # returns at once
        with pytest.raises(grpc.RpcError) as busy:  # one parameter operation at a time
            dst.stub.ResetStatus(pb.ResetStatusRequest(), timeout=CALL_TIMEOUT)
        assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        src.stub.SendParams(pb.SendParamsRequest(dst=1), timeout=CALL_TIMEOUT)
        for replica in (src, dst):
            replica.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)
        _check_serves_like_transformers([dst], src, expected)


def test_chain_multicast_to_three(model: Path, expected: tuple, tmp_path: Path) -> None:
    with weights_cluster(model, tmp_path, 4, inactive=[1, 2, 3]) as replicas:
        request = pb.BroadcastRequest(src_ranks=[0], dst_ranks=[3, 1, 2])  # chain 0 → 3 → 1 → 2
        for replica in replicas:
            replica.stub.RdmaBroadcast(request, timeout=CALL_TIMEOUT)
        for replica in replicas:
            replica.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)
        _check_serves_like_transformers(replicas[1:], replicas[0], expected)

        # the blocking variant (NvlBroadcast) after unloading two of them
        for replica in replicas[1:3]:
            replica.stub.ResetStatus(pb.ResetStatusRequest(), timeout=CALL_TIMEOUT)
            assert replica.health() == "inactive"
            replica.weights.params.buffer.zero_()  # prove the bytes really move again
        nvl = pb.BroadcastRequest(src_ranks=[3], dst_ranks=[2, 1])
        _all([_call(r.stub.NvlBroadcast, nvl) for r in replicas[1:]])
        _check_serves_like_transformers(replicas[1:3], replicas[0], expected)


def test_tanz_two_sources_four_receivers(model: Path, expected: tuple, tmp_path: Path) -> None:
    with weights_cluster(model, tmp_path, 6, inactive=[2, 3, 4, 5]) as replicas:
        request = pb.BroadcastRequest(src_ranks=[0, 1], dst_ranks=[2, 3, 4, 5])
        for replica in replicas:
            mover = replica.weights.mover
            assert mover is not None
            mover.options = _small_stripes(replica)  # several segments and stripes per region
        _all([_call(r.stub.TanzBroadcast, request) for r in replicas])
        _check_serves_like_transformers(replicas[2:], replicas[0], expected)


def _call(method: Callable[..., object], request: object) -> Callable[[], object]:
    return lambda: method(request, timeout=CALL_TIMEOUT)


def _small_stripes(replica: InProcReplica) -> TransferOptions:
    total = replica.weights.params.layout.total_bytes
    return TransferOptions(chunk_bytes=16 << 10, stripe_bytes=max(total // 7, 1024))
