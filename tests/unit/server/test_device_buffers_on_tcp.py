"""A replica whose KV and weights are in device memory on the tcp fabric (which moves host memory
only) still starts; the calls that would move those buffers fail FAILED_PRECONDITION naming why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from replica.cluster import KV_BUFFER, WEIGHT_BUFFER, ReplicaCluster, kv_layout_of, local_table
from replica.errors import FailedPrecondition
from replica.model.attention import PagedKVCache


@pytest.fixture
def cluster() -> Iterator[ReplicaCluster]:
    table = local_table(0, "127.0.0.1", 1)
    made = ReplicaCluster.start("tcp", table, 0, "127.0.0.1:1")
    yield made
    made.close()


def test_device_buffers_are_left_out_and_refused_with_the_reason(cluster: ReplicaCluster) -> None:
    cache = PagedKVCache(2, 4, 4, 1, 8, torch.float32, device="meta")  # device memory, as on a GPU
    cluster.register_kv(cache.tensor, kv_layout_of(cache))
    assert cluster.register_weights(torch.empty(64, dtype=torch.uint8, device="meta")) == 0
    for name in (KV_BUFFER, WEIGHT_BUFFER):
        with pytest.raises(FailedPrecondition, match=f"the {name} buffer is in meta memory.*recompute"):
            cluster.require_movable(name)
    with pytest.raises(FailedPrecondition, match="meta memory"):
        cluster.ensure_kv(cache.tensor)


def test_host_buffers_register_as_before(cluster: ReplicaCluster) -> None:
    cache = PagedKVCache(2, 4, 4, 1, 8, torch.float32)
    cluster.register_kv(cache.tensor, kv_layout_of(cache))
    cluster.ensure_kv(cache.tensor)
    assert cluster.register_weights(torch.zeros(64, dtype=torch.uint8)) == 64
    assert cluster.unmovable == {}


def test_a_bad_host_buffer_still_fails_registration(cluster: ReplicaCluster) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        cluster.register_weights(torch.zeros(8, 8)[:, ::2])
