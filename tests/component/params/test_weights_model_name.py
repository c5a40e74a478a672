"""Weight transfers carry the model's name: a receiver records the model its call names (Info
`weights_model`), so ResetStatus keeps its host copy under that name — a later LoadParams from host
memory of that model generates exactly what transformers generates on it, and the name of the model
the replica was started with finds nothing. A sender asked for another model than it holds refuses;
a transfer naming no model leaves the receiver's model unknown and keeps no host copy."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
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


def _info(replica: InProcReplica) -> pb.InfoResponse:
    return replica.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)


def _load(replica: InProcReplica, case: pb.LoadParamCase, name: str) -> None:
    replica.stub.LoadParams(pb.LoadParamsRequest(load_case=case, model_name=name), timeout=CALL_TIMEOUT)


def _reset(*replicas: InProcReplica) -> None:
    for replica in replicas:
        replica.stub.ResetStatus(pb.ResetStatusRequest(), timeout=CALL_TIMEOUT)


def _join(*replicas: InProcReplica) -> None:
    for replica in replicas:
        replica.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)


def _refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def test_p2p_and_chain_name_the_model_and_the_host_copy_keeps_it(alpha: Path, beta: Path,
                                                                  tmp_path: Path) -> None:
    prompts = prompts_for(512, count=2)
    want = reference(beta, prompts, MAX_NEW)
    assert want != reference(alpha, prompts, MAX_NEW)  # else serving alpha's weights would pass too
    with weights_cluster(alpha, tmp_path, 3, inactive=[1, 2]) as (src, p2p, chained):
        _reset(src)
        _load(src, pb.LOAD_FROM_DISK, beta.name)  # the source holds beta; the others started as alpha
        assert _info(p2p).weights_model == alpha.name
        wrong = _refused(lambda: src.stub.SendParams(pb.SendParamsRequest(dst=1, model_name=alpha.name)))
        assert wrong.code() == grpc.StatusCode.FAILED_PRECONDITION and beta.name in str(wrong.details())

        src.stub.SendParams(pb.SendParamsRequest(dst=1, model_name=beta.name), timeout=CALL_TIMEOUT)
        p2p.stub.RecvParams(pb.RecvParamsRequest(src=0, model_name=beta.name), timeout=CALL_TIMEOUT)
        _join(src, p2p)
        chain = pb.BroadcastRequest(src_ranks=[0], dst_ranks=[2], model_name=beta.name)
        for member in (src, chained):
            member.stub.RdmaBroadcast(chain, timeout=CALL_TIMEOUT)
        _join(src, chained)

        for i, replica in enumerate((p2p, chained)):
            assert _info(replica).weights_model == beta.name
            _reset(replica)
            replica.weights.params.buffer.zero_()  # what serves next comes from the host copy
            miss = _refused(functools.partial(_load, replica, pb.LOAD_FROM_HOST_MEM, alpha.name))
            assert miss.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "host cache miss" in str(miss.details())
            _load(replica, pb.LOAD_FROM_HOST_MEM, beta.name)
            assert generate(replica.stub, 1 + i, prompts, MAX_NEW) == want


def test_a_transfer_naming_no_model_keeps_no_host_copy(alpha: Path, tmp_path: Path) -> None:
    with weights_cluster(alpha, tmp_path, 2, inactive=[1]) as (src, dst):
        src.stub.SendParams(pb.SendParamsRequest(dst=1), timeout=CALL_TIMEOUT)
        dst.stub.RecvParams(pb.RecvParamsRequest(src=0), timeout=CALL_TIMEOUT)
        _join(src, dst)
        assert (_info(dst).weights_model, dst.health()) == ("", "serving")
        _reset(dst)
        assert dst.weights.params.host_cache.names() == []  # no copy kept under a guessed name
        alias = alpha.parent / f"alias-{os.getpid()}"  # a symlinked folder keeps the name it was asked by
        alias.symlink_to(alpha, target_is_directory=True)
        try:
            _load(dst, pb.LOAD_FROM_DISK, alias.name)
            assert _info(dst).weights_model == alias.name
        finally:
            alias.unlink()
