"""Roles and weights over real replicas in this process (tiny model): drain, mutation, SetRole,
activation by p2p and chain multicast, a strategy switch at run time, a joining replica cleared.
Failures of these are injected over fake replicas (test_router_core_faults.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from protos import generate_pb2 as pb
from router import control
from router.config import Strategy
from router.replicas import State, Trigger
from router.scheduler import ClusterScheduler
from router.types import ReplicaId
from router.weights import Method
from tests.helpers.eventually import eventually_async
from tests.helpers.router_core import (
    RealReplica,
    collect,
    finish_of,
    greedy,
    pages_back,
    real_cluster,
    request,
    run,
    tokens_of,
)

PD = (State.PREFILL, State.DECODE)


def role(sched: ClusterScheduler, rid: int) -> State:
    return sched.replicas[ReplicaId(rid)].state.role


def test_drain_finishes_work_then_idles(tiny_llama: Path, tmp_path: Path) -> None:
    want = greedy(tiny_llama)

    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.FULL) as (sched, replicas):
            task = asyncio.create_task(collect(sched.submit(request([2, 2], 60))))
            await eventually_async(lambda: "DecodeV2" in replicas[1].calls)
            control.drain(sched, 1)
            assert tokens_of(await task) == want([2, 2], 60)
            await eventually_async(lambda: role(sched, 1) is State.IDLE)
            later = await collect(sched.submit(request([2, 3], 4)))
            route = finish_of(later).route
            assert (route.prefill_replica, route.decode_replica) == (0, 0)
    run(body())


def test_mutate_swaps_roles_without_transfer(tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.MUTATE) as (sched, (p, d)):
            events = await collect(sched.submit(request([8, 1], 6)))
            assert tokens_of(events) == greedy(tiny_llama)([8, 1], 6)
            route = finish_of(events).route
            assert (route.prefill_replica, route.decode_replica, route.strategy) == (0, 0, "mutate")
            assert (role(sched, 0), role(sched, 1)) == (State.DECODE, State.PREFILL)
            assert "Migrate" not in p.calls and "Immigrate" not in d.calls
    run(body())


def test_set_role_prefill_to_decode_and_refusals(tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        roles = (State.PREFILL, State.DECODE, State.DECODE)
        async with real_cluster(tiny_llama, tmp_path, roles, Strategy.FULL) as (sched, _):
            await control.set_role(sched, 0, State.DECODE)
            assert role(sched, 0) is State.DECODE
            await control.set_role(sched, 1, State.PREFILL)
            with pytest.raises(KeyError):
                await control.set_role(sched, 9, State.PREFILL)
            events = await collect(sched.submit(request([1], 3)))
            assert finish_of(events).route.prefill_replica == 1
    run(body())


def test_activate_inactive_replicas_by_p2p_and_chain(tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        roles = (State.COLOCATED, State.INACTIVE, State.INACTIVE, State.INACTIVE)
        async with real_cluster(tiny_llama, tmp_path, roles, Strategy.FULL) as (sched, replicas):
            await control.activate(sched, [1], State.DECODE, Method.P2P)
            assert role(sched, 1) is State.DECODE
            assert "SendParams" in replicas[0].calls and "RecvParams" in replicas[1].calls
            await control.activate(sched, [2, 3], State.DECODE, Method.CHAIN)
            assert all(role(sched, i) is State.DECODE for i in (2, 3))
            chain = (replicas[0], *replicas[2:])
            assert all("RdmaBroadcast" in r.calls and "WaitRdmaDone" in r.calls for r in chain)
            await control.set_role(sched, 0, State.PREFILL)
            events = await collect(sched.submit(request([4, 5], 5)))
            assert tokens_of(events) == greedy(tiny_llama)([4, 5], 5)  # the moved weights generate
    run(body())


def test_p2p_from_one_source_to_two_targets_sends_one_after_the_other(tiny_llama: Path,
                                                                       tmp_path: Path) -> None:
    # a replica runs one parameter operation at a time: the second SendParams waits for the first
    async def body() -> None:
        roles = (State.COLOCATED, State.INACTIVE, State.INACTIVE)
        async with real_cluster(tiny_llama, tmp_path, roles, Strategy.FULL) as (sched, replicas):
            await control.activate(sched, [1, 2], State.DECODE, Method.P2P)
            assert all(role(sched, i) is State.DECODE for i in (1, 2))
            assert replicas[0].calls.count("SendParams") == 2
    run(body())


def test_strategy_switch_at_run_time_keeps_running_batches(tiny_llama: Path, tmp_path: Path) -> None:
    want = greedy(tiny_llama)

    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.COLOCATED) as (sched, replicas):
            idle = sched.replicas[ReplicaId(1)].state  # the batch must run on replica 0
            idle.move(State.DRAINING_DECODE, Trigger.DRAIN)
            idle.move(State.IDLE, Trigger.DRAINED)
            task = asyncio.create_task(collect(sched.submit(request([3, 3], 200))))
            await eventually_async(lambda: replicas[0].calls.count("DecodeV2") >= 3)
            await control.set_role(sched, 1, State.DECODE)
            sched.set_strategy(Strategy.FULL)
            later = await collect(sched.submit(request([4, 4], 5)))
            assert finish_of(later).route.strategy == "full"
            events = await task
            assert tokens_of(events) == want([3, 3], 200)
            assert finish_of(events).route.strategy == "colocated"
            await pages_back(replicas)
    run(body())


def test_a_joining_replica_is_cleared_first(tiny_llama: Path, tmp_path: Path) -> None:
    # whatever it holds is nobody's: batches of a router that died (this router restarted against
    # the same replicas), or of its own former life here (declared dead, registering again)
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.FULL, spare=1) as (sched, replicas):
            d, returning = replicas[1:]
            await left_behind(returning, 998)  # an old router's batch
            rid = await sched.add_replica(returning.address, State.DECODE, registered=True)
            total, free = await returning.pages()
            assert free == total and sched.replicas[rid].state.info.num_blocks_free == total
            sched.mark_dead(rid, "missed its heartbeat deadline")
            await left_behind(returning, 999)  # a batch of its former life, re-run elsewhere
            others = d.calls.count("ClearCache")
            again = await sched.add_replica(returning.address, State.DECODE, registered=True)
            assert again != rid and role(sched, again) is State.DECODE
            assert await returning.pages() == (total, total) and returning.calls.count("ClearCache") == 2
            assert d.calls.count("ClearCache") == others  # nobody else is touched
    run(body())


async def left_behind(replica: RealReplica, batch_id: int) -> None:
    """Prefill a batch on `replica` behind the router's back."""
    stopping = pb.StoppingCriteriaParameters(max_new_tokens=4)
    one = pb.Request(id=batch_id, input_tokens=[5], stopping_parameters=stopping)
    batch = pb.Batch(id=batch_id, requests=[one])
    await asyncio.to_thread(replica.replica.stub.PrefillV2, pb.PrefillV2Request(batch=batch), timeout=30)
