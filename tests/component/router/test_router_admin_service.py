"""The admin gRPC service in-process over real replicas in this process: token, list, stats,
strategy, roles, and self-registration with heartbeats (replica/server/registration.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio
import pytest

from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc
from replica.server.registration import RouterRegistration
from router.admin import start_admin_server
from router.config import Strategy
from router.replicas import State
from router.types import ReplicaId
from tests.helpers.eventually import eventually_async
from tests.helpers.router_core import collect, finish_of, real_cluster, request, run, tokens_of

TOKEN = (("x-admin-token", "s3cret"),)
PD = (State.PREFILL, State.DECODE)


def test_admin_calls_token_list_stats_strategy_and_roles(tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.FULL) as (sched, _):
            server, port = await start_admin_server(sched, "127.0.0.1", 0, token="s3cret")
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pb_grpc.RouterAdminStub(channel)
                    generated = tokens_of(await collect(sched.submit(request([1, 2], 3))))
                    listed = await stub.ListReplicas(pb.ListReplicasRequest())
                    roles = [r.role for r in listed.replicas]
                    assert roles == [pb.REPLICA_ROLE_PREFILL, pb.REPLICA_ROLE_DECODE]
                    stats = await stub.Stats(pb.StatsRequest())
                    assert stats.requests_finished == 1 and stats.generated_tokens == len(generated)
                    assert stats.migrations == 1 and stats.strategy == pb.MIGRATION_STRATEGY_FULL
                    with pytest.raises(grpc.aio.AioRpcError) as denied:
                        await stub.SetMigrationStrategy(pb.SetMigrationStrategyRequest(
                            strategy=pb.MIGRATION_STRATEGY_RECOMPUTE), metadata=(("x-admin-token", "nope"),))
                    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    prev = await stub.SetMigrationStrategy(pb.SetMigrationStrategyRequest(
                        strategy=pb.MIGRATION_STRATEGY_RECOMPUTE), metadata=TOKEN)
                    assert prev.previous == pb.MIGRATION_STRATEGY_FULL
                    assert sched.strategy.name == Strategy.RECOMPUTE.value
                    events = await collect(sched.submit(request([1, 2], 3)))
                    assert finish_of(events).route.strategy == "recompute"
                    with pytest.raises(grpc.aio.AioRpcError) as missing:
                        await stub.Drain(pb.DrainRequest(replica_id=7), metadata=TOKEN)
                    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
                    with pytest.raises(grpc.aio.AioRpcError) as bad:
                        await stub.SetRole(pb.SetRoleRequest(replica_id=1, role=pb.REPLICA_ROLE_LOADING),
                                           metadata=TOKEN)
                    assert bad.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    drained = await stub.Drain(pb.DrainRequest(replica_id=1), metadata=TOKEN)
                    assert drained.replica.role in (pb.REPLICA_ROLE_DRAINING_DECODE, pb.REPLICA_ROLE_IDLE)
                    assert drained.replica.state in ("draining_decode", "idle")
            finally:
                await server.stop(None)
    run(body())


def test_self_registration_heartbeats_and_expiry(tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        # a deadline long beside the beats (one every 0.1 s): real replicas share this process's
        # interpreter, and a beat held up on a loaded machine must not look like a death
        async with real_cluster(tiny_llama, tmp_path, (State.PREFILL,), Strategy.RECOMPUTE,
                                spare=1, heartbeat_timeout=1.5) as (sched, (_, extra)):
            server, port = await start_admin_server(sched, "127.0.0.1", 0, token="s3cret")
            reg = RouterRegistration(f"127.0.0.1:{port}", extra.address, role="decode", token="s3cret",
                                     retry_seconds=0.05)
            try:
                reg.start()
                await asyncio.to_thread(reg.registered.wait, 10)
                assert reg.replica_id == 1
                handle = sched.replicas[ReplicaId(1)]

                def role() -> State:
                    return handle.state.role

                assert handle.state.registered and role() is State.DECODE
                # the behaviour under test is time passing: twice the heartbeat timeout, and the
                # beats keep it alive
                await asyncio.sleep(3.0)
                assert role() is State.DECODE
                events = await collect(sched.submit(request([6], 4)))
                assert finish_of(events).route.decode_replica == 1
                await asyncio.to_thread(reg.stop)
                await eventually_async(lambda: role() is State.DEAD, message="dead once the beats stop")
            finally:
                await asyncio.to_thread(reg.stop)
                await server.stop(None)
    run(body())


def test_strategies_are_set_and_reported_by_their_registered_name(tiny_llama: Path,
                                                                  tmp_path: Path) -> None:
    # a plug-in strategy has no enum value: the name fields carry it (enum UNSPECIFIED)
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.FULL) as (sched, _):
            server, port = await start_admin_server(sched, "127.0.0.1", 0)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pb_grpc.RouterAdminStub(channel)
                    prev = await stub.SetMigrationStrategy(pb.SetMigrationStrategyRequest(name="progressive"))
                    assert (prev.previous, prev.previous_name) == (pb.MIGRATION_STRATEGY_FULL, "full")
                    stats = await stub.Stats(pb.StatsRequest())
                    assert stats.strategy == pb.MIGRATION_STRATEGY_PROGRESSIVE
                    assert stats.strategy_name == "progressive"
                    with pytest.raises(grpc.aio.AioRpcError) as unknown:
                        await stub.SetMigrationStrategy(pb.SetMigrationStrategyRequest(name="teleport"))
                    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "teleport" in str(unknown.value.details()) and sched.strategy.name == "progressive"
            finally:
                await server.stop(None)
    run(body())
