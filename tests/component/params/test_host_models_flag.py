"""`--host-models`: checkpoints kept in host memory from the start. A replica of `alpha` started
with beta's copy lists it in Info, loads it by LoadParams LOAD_FROM_HOST_MEM and then answers as
transformers does on beta; a name that is not under the model root, or a checkpoint of another shape,
fails the start naming the flag; `--tp > 1` refuses the flag (a group keeps no host copies)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from protos import generate_pb2 as pb
from replica.config import ReplicaConfig
from tests.helpers.weights_cluster import CALL_TIMEOUT, generate, prompts_for, reference, weights_cluster

MAX_NEW = 5


def test_a_replica_starts_with_another_models_host_copy(alpha: Path, beta: Path, tmp_path: Path) -> None:
    prompts = prompts_for(512, count=2)
    want = reference(beta, prompts, MAX_NEW)
    assert want != reference(alpha, prompts, MAX_NEW)
    with weights_cluster(alpha, tmp_path, 1, inactive=[0], host_models=[beta.name]) as (replica,):
        info = replica.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT)
        assert [c.model for c in info.host_copies] == [beta.name]
        replica.stub.LoadParams(pb.LoadParamsRequest(load_case=pb.LOAD_FROM_HOST_MEM, model_name=beta.name),
                                timeout=CALL_TIMEOUT)
        assert generate(replica.stub, 1, prompts, MAX_NEW) == want


def _start(model: Path, folder: Path, held: str) -> None:
    with weights_cluster(model, folder, 1, host_models=[held]):
        pass


def test_a_missing_or_other_shaped_host_model_fails_the_start(
        alpha: Path, tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--host-models no-such-model: no checkpoint"):
        _start(alpha, tmp_path, "no-such-model")
    other = tiny_model_factory(arch="llama", layers=3)  # another layout
    with pytest.raises(ValueError, match=f"--host-models {other.name}: .*different weight layout"):
        _start(alpha, tmp_path / "other", other.name)


def test_a_tensor_parallel_replica_refuses_host_models(alpha: Path) -> None:
    with pytest.raises(ValueError, match="keeps no host-memory copies"):
        ReplicaConfig(model=alpha, port=0, tp=2, num_blocks=16, host_models=["beta"])
