"""The admin service and `/metrics` of a router with several models, over fake replicas: ListReplicas
names each replica's model (the spare pool's with ""), filters by model (unknown: NOT_FOUND), a
Drain addresses the model holding the replica, and `pdcluster_replicas` counts per model."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc
from router.admin import start_admin_server
from router.client import ReplicaClient
from router.metrics import RouterMetrics
from router.pools import ModelPools
from router.replicas import State
from router.scheduler import ClusterScheduler
from tests.helpers.fake_batches import expected_tokens
from tests.helpers.fake_replica import FakeFabric, FakeReplica
from tests.helpers.router_core import FakeDecoder, collect, config, request, run, tokens_of


def _scheduler(name: str, ids: itertools.count[int], metrics: RouterMetrics,
               **overrides: Any) -> ClusterScheduler:
    cfg = config(model=Path(name), **overrides)

    def connect(address: str) -> ReplicaClient:
        return ReplicaClient(address, cfg.rpc_timeout, cfg.transfer_timeout)

    return ClusterScheduler(cfg, FakeDecoder(), connect, metrics, kv_bytes_per_token=8, ids=ids)


@contextlib.asynccontextmanager
async def _admin(first: ClusterScheduler, pools: ModelPools, fakes: list[FakeReplica]
                 ) -> AsyncIterator[pb_grpc.RouterAdminStub]:
    """The pools started and the admin service over them, as a stub; everything stopped after."""
    await pools.start()
    server, port = await start_admin_server(first, "127.0.0.1", 0, pools=pools)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.RouterAdminStub(channel)
    finally:
        await server.stop(None)
        await pools.stop()
        for fake in fakes:
            await fake.stop()


def _models(listed: pb.ListReplicasResponse) -> list[tuple[int, str, str]]:
    return [(r.id, r.model, r.state) for r in listed.replicas]


def test_list_replicas_and_metrics_name_each_model(tmp_path: Path) -> None:
    async def body() -> None:
        fabric, ids, metrics = FakeFabric(), itertools.count(0), RouterMetrics()
        fakes = [FakeReplica(rank, fabric, loaded=rank < 2) for rank in range(3)]
        first = _scheduler("first", ids, metrics)
        second = _scheduler("second", ids, metrics, min_prefill=0, min_decode=0)
        await first.add_replica(await fakes[0].start(), State.PREFILL)
        await first.add_replica(await fakes[1].start(), State.DECODE)
        pools = ModelPools({"first": first, "second": second}, [await fakes[2].start()], 10.0, 0.1)
        count = metrics.registry.get_sample_value
        async with _admin(first, pools, fakes) as stub:
            before = await stub.ListReplicas(pb.ListReplicasRequest())
            spare = (0, "", "inactive")  # the shared pool's replica: no id, no model
            assert _models(before) == [(0, "first", "prefill"), (1, "first", "decode"), spare]
            assert count("pdcluster_replicas", {"state": "inactive", "model": ""}) == 1
            woken = await asyncio.wait_for(collect(pools.front("second").submit(request([5], 4))), 20)
            assert tokens_of(woken) == expected_tokens([5], 4)
            only = await stub.ListReplicas(pb.ListReplicasRequest(model="second"))
            assert [(r.id, r.model) for r in only.replicas] == [(2, "second")]
            assert count("pdcluster_replicas", {"state": "prefill", "model": "first"}) == 1
            assert count("pdcluster_replicas", {"state": "prefill", "model": "second"}) == 1
            assert count("pdcluster_replicas", {"state": "inactive", "model": ""}) == 0
            drained = await stub.Drain(pb.DrainRequest(replica_id=2))  # second's, not the first model's
            assert (drained.replica.id, drained.replica.model) == (2, "second")
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.ListReplicas(pb.ListReplicasRequest(model="gamma"))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            assert "gamma" in str(unknown.value.details())
    run(body())


def test_stats_strategy_policy_and_registration_address_each_model() -> None:
    """Stats of one model or of all, the strategy and scaling policy per model or for all, a replica
    registering into the model its Info names (or the one asked for), its heartbeats reaching that
    model, and a registered inactive replica never given back to the spare pool."""
    async def body() -> None:
        fabric, ids, metrics = FakeFabric(), itertools.count(0), RouterMetrics()
        fakes = [FakeReplica(rank, fabric, loaded=rank < 3) for rank in range(4)]
        fakes[2].model_name = "second"
        first = _scheduler("first", ids, metrics)
        second = _scheduler("second", ids, metrics, min_prefill=0, min_decode=0)
        await first.add_replica(await fakes[0].start(), State.PREFILL)
        await first.add_replica(await fakes[1].start(), State.DECODE)
        pools = ModelPools({"first": first, "second": second}, [], 10.0, 0.1)
        async with _admin(first, pools, fakes) as stub:
            done = await asyncio.wait_for(collect(pools.front("first").submit(request([5], 4))), 20)
            assert tokens_of(done) == expected_tokens([5], 4)
            every, one, other = [await stub.Stats(pb.StatsRequest(model=m))
                                 for m in ("", "first", "second")]
            assert (every.requests_finished, one.requests_finished, other.requests_finished) == (1, 1, 0)
            assert (every.generated_tokens, other.generated_tokens) == (4, 0)
            assert (one.model, other.model) == ("first", "second")
            await stub.SetMigrationStrategy(pb.SetMigrationStrategyRequest(name="recompute",
                                                                           model="second"))
            assert (first.strategy.name, second.strategy.name) == ("full", "recompute")
            await stub.SetMigrationStrategy(pb.SetMigrationStrategyRequest(name="progressive"))
            assert (first.strategy.name, second.strategy.name) == ("progressive", "progressive")
            await stub.SetScalingPolicy(pb.SetScalingPolicyRequest(name="multicast", model="second"))
            assert (first.scaling.policy.name, second.scaling.policy.name) == ("static", "multicast")
            for call, message in ((stub.Stats, pb.StatsRequest(model="gamma")),
                                  (stub.SetScalingPolicy, pb.SetScalingPolicyRequest(name="static",
                                                                                     model="gamma"))):
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await call(message)
                assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            joined = await stub.RegisterReplica(pb.RegisterReplicaRequest(address=await fakes[2].start()))
            assert joined.replica_id in second.replicas  # the model its weights are of
            spare = await stub.RegisterReplica(pb.RegisterReplicaRequest(
                address=await fakes[3].start(), role=pb.REPLICA_ROLE_INACTIVE, model="second"))
            assert spare.replica_id in second.replicas
            beat = await stub.Heartbeat(pb.HeartbeatRequest(replica_id=joined.replica_id))
            assert beat.known
            await pools.rebalance()  # second wants nothing: an unregistered inactive one would go
            assert spare.replica_id in second.replicas and pools.spare == []
    run(body())
