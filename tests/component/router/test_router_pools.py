"""Several models over fake replicas (`router/pools.py`): a model at zero is woken by its first
requests (one wake shared by them, the spare replica lent and loaded), and one that cannot be woken
answers 503 once `--wake-timeout` has passed."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

from router.client import ReplicaClient
from router.pools import ModelPools
from router.replicas import State
from router.scheduler import ClusterScheduler
from tests.helpers.fake_batches import expected_tokens
from tests.helpers.fake_replica import FakeFabric, FakeReplica
from tests.helpers.router_core import FakeDecoder, collect, config, error_of, request, run, tokens_of


def _scheduler(name: str, ids: itertools.count[int], **overrides: Any) -> ClusterScheduler:
    cfg = config(model=Path(name), **overrides)

    def connect(address: str) -> ReplicaClient:
        return ReplicaClient(address, cfg.rpc_timeout, cfg.transfer_timeout)

    return ClusterScheduler(cfg, FakeDecoder(), connect, kv_bytes_per_token=8, ids=ids)


def test_a_model_at_zero_borrows_the_spare_replica_for_its_first_requests() -> None:
    async def body() -> None:
        fabric, ids = FakeFabric(), itertools.count(0)
        fakes = [FakeReplica(rank, fabric, loaded=rank < 2) for rank in range(3)]
        first, second = _scheduler("first", ids), _scheduler("second", ids, min_prefill=0, min_decode=0)
        await first.add_replica(await fakes[0].start(), State.PREFILL)
        await first.add_replica(await fakes[1].start(), State.DECODE)
        pools = ModelPools({"first": first, "second": second}, [await fakes[2].start()], 10.0, 0.1)
        await pools.start()
        try:
            waiting = [collect(pools.front("second").submit(request([5, i], 4))) for i in range(3)]
            results = await asyncio.wait_for(asyncio.gather(*waiting), 20)
            for i, events in enumerate(results):
                assert tokens_of(events) == expected_tokens([5, i], 4)
            assert pools.wakes == 1 and not pools.spare  # one wake for the three, the spare lent
            assert [h.id for h in second.replicas.values()] == [2]  # ids unique across the models
            assert fakes[2].loaded and "LoadParams" in fakes[2].calls
            assert tokens_of(await collect(pools.front("first").submit(request([7], 3)))) == \
                expected_tokens([7], 3)
        finally:
            await pools.stop()
            for fake in fakes:
                await fake.stop()
    run(body())


def test_a_model_that_cannot_be_woken_answers_503_after_the_wake_timeout() -> None:
    async def body() -> None:
        fabric, ids = FakeFabric(), itertools.count(0)
        fake = FakeReplica(0, fabric)
        first, second = _scheduler("first", ids), _scheduler("second", ids)
        await first.add_replica(await fake.start(), State.COLOCATED)
        pools = ModelPools({"first": first, "second": second}, [], 0.3, 0.1)  # no spare replica
        await pools.start()
        try:
            events = await asyncio.wait_for(collect(pools.front("second").submit(request([1], 2))), 10)
            assert error_of(events).http_status == 503 and "within 0.3 s" in error_of(events).message
        finally:
            await pools.stop()
            await fake.stop()
    run(body())
