"""SendParams of a host-memory copy (`host_copy_model`): a replica serving one model sends the copy
of another model that its host memory keeps to an inactive peer over the fabric, region by region,
as it sends its weight buffer; the receiver records the model and generates exactly what
transformers generates on it, while the sender goes on serving its own model. Info lists the host
copies (names, bytes); a copy the sender does not hold is NOT_FOUND. Two replicas holding the copy
each send one share of it to one receiver at once (RecvParams `more_srcs`, SendParams `share`)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos import generate_pb2 as pb
from tests.helpers.weights_cluster import (
    CALL_TIMEOUT,
    InProcReplica,
    generate,
    prompts_for,
    reference,
    weights_cluster,
)

MAX_NEW = 6


def _load(replica: InProcReplica, case: pb.LoadParamCase, name: str) -> None:
    replica.stub.LoadParams(pb.LoadParamsRequest(load_case=case, model_name=name), timeout=CALL_TIMEOUT)


def _reset(replica: InProcReplica) -> None:
    replica.stub.ResetStatus(pb.ResetStatusRequest(), timeout=CALL_TIMEOUT)


def test_a_host_copy_goes_to_a_peer_and_generates_like_transformers(alpha: Path, beta: Path,
                                                                     tmp_path: Path) -> None:
    prompts = prompts_for(512, count=2)
    want_alpha, want_beta = reference(alpha, prompts, MAX_NEW), reference(beta, prompts, MAX_NEW)
    assert want_alpha != want_beta  # else the receiver serving alpha's weights would pass too
    with weights_cluster(alpha, tmp_path, 2, inactive=[1]) as (src, dst):
        _reset(src)  # host memory: alpha
        _load(src, pb.LOAD_FROM_DISK, beta.name)
        _reset(src)  # host memory: alpha and beta
        _load(src, pb.LOAD_FROM_HOST_MEM, alpha.name)  # the sender serves alpha again
        info = src.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)
        nbytes = src.weights.params.layout.total_bytes
        assert [(c.model, c.bytes) for c in info.host_copies] == [(beta.name, nbytes), (alpha.name, nbytes)]

        dst.stub.RecvParams(pb.RecvParamsRequest(src=0, model_name=beta.name), timeout=CALL_TIMEOUT)
        src.stub.SendParams(pb.SendParamsRequest(dst=1, host_copy_model=beta.name), timeout=CALL_TIMEOUT)
        for replica in (src, dst):
            replica.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)

        assert dst.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).weights_model == beta.name
        assert generate(dst.stub, 1, prompts, MAX_NEW) == want_beta
        assert generate(src.stub, 2, prompts, MAX_NEW) == want_alpha  # its buffer was not touched


def test_a_host_copy_the_sender_does_not_hold_is_not_found(alpha: Path, tmp_path: Path) -> None:
    with weights_cluster(alpha, tmp_path, 2, inactive=[1]) as (src, _dst):
        with pytest.raises(grpc.RpcError) as error:
            src.stub.SendParams(pb.SendParamsRequest(dst=1, host_copy_model=alpha.name), timeout=CALL_TIMEOUT)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND  # loaded, but no host copy kept yet
        assert alpha.name in str(error.value.details())
        assert src.weights.ops.busy is False  # the guard is free for the next operation


def test_two_holders_each_send_a_share_of_the_host_copy(alpha: Path, beta: Path, tmp_path: Path) -> None:
    prompts = prompts_for(512, count=2)
    want = reference(beta, prompts, MAX_NEW)
    with weights_cluster(alpha, tmp_path, 3, inactive=[2]) as (first, second, dst):
        for holder in (first, second):  # each keeps beta in host memory and serves alpha again
            for load in (None, beta.name, None, alpha.name):
                if load is None:
                    _reset(holder)
                else:
                    _load(holder, pb.LOAD_FROM_DISK if load == beta.name else pb.LOAD_FROM_HOST_MEM, load)
        dst.stub.RecvParams(pb.RecvParamsRequest(src=0, more_srcs=[1], model_name=beta.name),
                            timeout=CALL_TIMEOUT)
        for i, holder in enumerate((first, second)):
            request = pb.SendParamsRequest(dst=2, host_copy_model=beta.name, share=i, shares=2)
            holder.stub.SendParams(request, timeout=CALL_TIMEOUT)
        for replica in (first, second, dst):
            replica.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)
        assert generate(dst.stub, 1, prompts, MAX_NEW) == want
        with pytest.raises(grpc.RpcError) as error:  # a share that is not one of them
            first.stub.SendParams(pb.SendParamsRequest(dst=2, host_copy_model=beta.name, share=2, shares=2),
                                  timeout=CALL_TIMEOUT)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
