"""One weight buffer with room for the largest model (`--weight-buffer-bytes`): a replica started with
a small checkpoint loads a larger one of another shape (layers, hidden size) from disk, takes the
small one back by p2p, and the larger one from its host copy — each time generating exactly what
transformers generates on that checkpoint; a model larger than the buffer is refused, naming sizes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from protos import generate_pb2 as pb
from replica.model.config import ModelConfig
from replica.model.layout import WeightLayout
from tests.helpers.weights_cluster import (
    CALL_TIMEOUT,
    InProcReplica,
    generate,
    prompts_for,
    reference,
    weights_cluster,
)

MAX_NEW = 6


def _bytes(model: Path) -> int:
    return WeightLayout.for_config(ModelConfig.from_dir(model), "float32").total_bytes


def _info(replica: InProcReplica) -> pb.InfoResponse:
    return replica.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)


def _load(replica: InProcReplica, case: pb.LoadParamCase, name: str) -> None:
    replica.stub.LoadParams(pb.LoadParamsRequest(load_case=case, model_name=name), timeout=CALL_TIMEOUT)


def _reset(replica: InProcReplica) -> None:
    replica.stub.ResetStatus(pb.ResetStatusRequest(), timeout=CALL_TIMEOUT)


def _serves(replica: InProcReplica, model: Path, layers: int, want: list[list[int]], batch: int) -> None:
    info = _info(replica)
    assert (info.weights_model, info.model_id, info.num_layers, info.num_layers_loaded) == (
        model.name, model.name, layers, layers)
    assert generate(replica.stub, batch, prompts_for(512, count=2), MAX_NEW) == want
    assert replica.free_blocks() == info.num_blocks_total  # nothing leaked in the new KV cache


@pytest.fixture(scope="module")
def small(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=2)


@pytest.fixture(scope="module")
def large(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=3, hidden=96, intermediate=192, seed=5)


@pytest.fixture(scope="module")
def too_large(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=4, hidden=128, intermediate=256)


def test_a_replica_switches_between_models_of_different_shapes(small: Path, large: Path, too_large: Path,
                                                               tmp_path: Path) -> None:
    prompts = prompts_for(512, count=2)
    want = {m: reference(m, prompts, MAX_NEW) for m in (small, large)}
    room = _bytes(large)
    assert _bytes(small) < room < _bytes(too_large)
    with weights_cluster(small, tmp_path, 2, inactive=[1], weight_buffer_bytes=room) as (holder, spare):
        blocks = _info(spare).num_blocks_total
        _load(spare, pb.LOAD_FROM_DISK, large.name)  # another shape: buffer and KV pages laid out anew
        _serves(spare, large, 3, want[large], 1)
        assert _info(spare).num_blocks_total < blocks  # the same KV bytes hold fewer of its pages

        _reset(spare)  # large's host copy kept; now small back by p2p from the replica holding it
        # the receiver first: it lays itself out before the sender's connection meets its handshake
        spare.stub.RecvParams(pb.RecvParamsRequest(src=0, model_name=small.name), timeout=CALL_TIMEOUT)
        holder.stub.SendParams(pb.SendParamsRequest(dst=1, model_name=small.name), timeout=CALL_TIMEOUT)
        for replica in (holder, spare):
            replica.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)
        _serves(spare, small, 2, want[small], 2)
        assert _info(spare).num_blocks_total == blocks

        _reset(spare)
        _load(spare, pb.LOAD_FROM_HOST_MEM, large.name)  # from its host copy, laid out for it again
        _serves(spare, large, 3, want[large], 3)

        _reset(spare)
        with pytest.raises(grpc.RpcError) as refused:
            _load(spare, pb.LOAD_FROM_DISK, too_large.name)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"needs {_bytes(too_large)} bytes" in str(refused.value.details())
        assert f"holds {room}" in str(refused.value.details())
        _load(spare, pb.LOAD_FROM_DISK, small.name)  # the refusal changed nothing
        _serves(spare, small, 2, want[small], 4)
