"""LoadParams from disk (confined to the model root) and from the host copy; ResetStatus,
SetStatusReady; an inactive replica loaded from disk generates exactly what transformers does."""

from __future__ import annotations

import time
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
from transfer.tcp.ratelimit import MAX_LAG_S

MAX_NEW = 5
GBPS = 0.05  # a few MB of tiny weights take ~0.1 s: well above the pacer's idle allowance


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=3)


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def _load(replica: InProcReplica, case: pb.LoadParamCase, **fields: str) -> object:
    return replica.stub.LoadParams(pb.LoadParamsRequest(load_case=case, **fields), timeout=CALL_TIMEOUT)


def test_load_from_disk_and_host_memory(model: Path, tmp_path: Path) -> None:
    prompts = prompts_for(512, count=2)
    want = reference(model, prompts, MAX_NEW)
    (tmp_path / "escape").symlink_to("/etc")  # under the root (the session temp dir), resolving outside
    (tmp_path / "empty").mkdir()
    with weights_cluster(model, tmp_path, 1, inactive=[0]) as (replica,):
        disk = pb.LOAD_FROM_DISK
        assert (
            _code(lambda: _load(replica, disk, model_name="x", model_path="/etc"))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        escape = str(tmp_path / "escape")
        assert (
            _code(lambda: _load(replica, disk, model_name="x", model_path=escape))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        assert _code(lambda: _load(replica, disk, model_name="../..")) == grpc.StatusCode.PERMISSION_DENIED
        empty = str(tmp_path / "empty")
        assert (
            _code(lambda: _load(replica, disk, model_name="x", model_path=empty)) == grpc.StatusCode.NOT_FOUND
        )
        host = pb.LOAD_FROM_HOST_MEM
        assert _code(lambda: _load(replica, host)) == grpc.StatusCode.FAILED_PRECONDITION  # no copy yet
        assert replica.health() == "inactive"

        _load(replica, disk, model_name=model.name)  # a folder under the root, by name
        assert replica.health() == "serving"
        assert generate(replica.stub, 1, prompts, MAX_NEW) == want
        assert (
            _code(lambda: _load(replica, disk, model_name=model.name)) == grpc.StatusCode.FAILED_PRECONDITION
        )

        replica.stub.ResetStatus(pb.ResetStatusRequest(), timeout=CALL_TIMEOUT)
        assert replica.health() == "inactive"
        replica.weights.params.buffer.zero_()
        _load(replica, host)
        assert generate(replica.stub, 2, prompts, MAX_NEW) == want
        assert replica.free_blocks() == 64


def test_set_status_ready_needs_the_flag(model: Path, tmp_path: Path) -> None:
    with weights_cluster(model, tmp_path, 1, inactive=[0]) as (replica,):
        request = pb.SetStatusReadyRequest()
        code = _code(lambda: replica.stub.SetStatusReady(request, timeout=CALL_TIMEOUT))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    with weights_cluster(model, allowed, 1, inactive=[0], allow_set_status_ready=True) as (replica,):
        replica.stub.SetStatusReady(pb.SetStatusReadyRequest(), timeout=CALL_TIMEOUT)
        assert replica.health() == "serving"


def test_host_cache_serves_load_from_host_memory_at_the_emulated_rate(model: Path, tmp_path: Path) -> None:
    prompts = prompts_for(512, count=2)
    want = reference(model, prompts, MAX_NEW)
    # --host-cache: the node keeps the checkpoint in host memory from the start (host-cache baseline)
    with weights_cluster(model, tmp_path, 1, inactive=[0], host_cache=True, host_gbps=GBPS) as (replica,):
        store = replica.weights.params
        seconds = store.layout.total_bytes * 8 / (GBPS * 1e9)
        start = time.monotonic()
        _load(replica, pb.LOAD_FROM_HOST_MEM)
        took = time.monotonic() - start
        assert replica.health() == "serving"
        assert generate(replica.stub, 1, prompts, MAX_NEW) == want
    # a lower bound only: the emulated device never delivers faster than its rate (after the pacer's
    # allowance for an idle link's first bytes)
    assert took >= seconds - MAX_LAG_S, f"{store.layout.total_bytes} bytes in {took:.3f} s at {GBPS} Gbit/s"


def test_a_host_cache_smaller_than_the_model_misses_and_disk_still_loads(model: Path, tmp_path: Path) -> None:
    small = {"host_cache": True, "host_cache_bytes": 1024}  # far smaller than the model
    with weights_cluster(model, tmp_path, 1, inactive=[0], **small) as (replica,):
        with pytest.raises(grpc.RpcError) as error:
            _load(replica, pb.LOAD_FROM_HOST_MEM)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "host cache miss" in str(error.value.details())
        _load(replica, pb.LOAD_FROM_DISK, model_name=model.name)
        assert replica.health() == "serving"
        assert replica.weights.params.host_cache.names() == []  # ResetStatus would not keep it either


def test_load_from_disk_is_paced_region_by_region(model: Path, tmp_path: Path) -> None:
    with weights_cluster(model, tmp_path, 1, inactive=[0], disk_gbps=GBPS) as (replica,):
        store = replica.weights.params
        seconds = store.layout.total_bytes * 8 / (GBPS * 1e9)
        start = time.monotonic()
        _load(replica, pb.LOAD_FROM_DISK, model_name=model.name)
        assert time.monotonic() - start >= seconds - MAX_LAG_S
        assert replica.health() == "serving"
