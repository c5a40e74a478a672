"""Device buffers on the tcp fabric. CUDA tensors go through the staging fabric (`needs_staging`
decides; a CPU double of device memory stands in for CUDA here); memory no fabric can move (a meta
tensor: no bytes at all) is left out, the replica still starts, and the calls that would move those
buffers fail FAILED_PRECONDITION naming why."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from replica.cluster import KV_BUFFER, WEIGHT_BUFFER, ReplicaCluster, kv_layout_of, local_table, needs_staging
from replica.errors import FailedPrecondition
from replica.model.attention import PagedKVCache
from tests.helpers.staged_devices import DoubleDevices
from transfer.staged import StagedFabric


@pytest.fixture
def cluster() -> Iterator[ReplicaCluster]:
    table = local_table(0, "127.0.0.1", 1)
    made = ReplicaCluster.start("tcp", table, 0, "127.0.0.1:1")
    yield made
    made.close()


def test_tcp_is_staged_exactly_when_a_buffer_is_in_cuda_memory() -> None:
    assert needs_staging("tcp", ["cuda", "cpu"]) and needs_staging("tcp", ["cuda"])
    assert not needs_staging("tcp", ["cpu", "cpu"])
    assert not needs_staging("tcp", ["meta"])  # nothing to stage: tcp refuses it with the reason
    assert not needs_staging("nccl", ["cuda"]) and not needs_staging("rdma", ["cuda"])


def test_memory_without_bytes_is_left_out_and_refused_with_the_reason(cluster: ReplicaCluster) -> None:
    cache = PagedKVCache(2, 4, 4, 1, 8, torch.float32, device="meta")  # no memory at all
    cluster.register_kv(cache.tensor, kv_layout_of(cache))
    assert cluster.register_weights(torch.empty(64, dtype=torch.uint8, device="meta")) == 0
    for name in (KV_BUFFER, WEIGHT_BUFFER):
        reason = f"the {name} buffer is in meta memory.*no memory.*recompute"
        with pytest.raises(FailedPrecondition, match=reason):
            cluster.require_movable(name)
    with pytest.raises(FailedPrecondition, match="meta memory"):
        cluster.ensure_kv(cache.tensor)


def test_device_buffers_on_staged_tcp_are_movable() -> None:
    table = local_table(0, "127.0.0.1", 1)
    staged = ReplicaCluster.start("tcp", table, 0, "127.0.0.1:1", staging=DoubleDevices())
    try:
        assert isinstance(staged.fabric, StagedFabric)
        kv = np.zeros(4096, np.uint8)  # device memory to the double, as a CUDA tensor is to TorchDevices
        staged.ensure_kv(kv)
        assert staged.register_weights(np.zeros(64, np.uint8)) == 64
        staged.require_movable(WEIGHT_BUFFER)
        assert staged.unmovable == {}
        with pytest.raises(FailedPrecondition, match="meta memory"):  # staging does not make bytes up
            staged.register_weights(torch.empty(8, device="meta"))
            staged.require_movable(WEIGHT_BUFFER)
    finally:
        staged.close()


def test_host_buffers_register_as_before(cluster: ReplicaCluster) -> None:
    cache = PagedKVCache(2, 4, 4, 1, 8, torch.float32)
    cluster.register_kv(cache.tensor, kv_layout_of(cache))
    cluster.ensure_kv(cache.tensor)
    assert cluster.register_weights(torch.zeros(64, dtype=torch.uint8)) == 64
    assert cluster.unmovable == {}


def test_a_bad_host_buffer_still_fails_registration(cluster: ReplicaCluster) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        cluster.register_weights(torch.zeros(8, 8)[:, ::2])
