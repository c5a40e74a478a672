"""The autoscaler over fake replicas: rounds driven by hand (a long plan interval), the executor's
methods, rollback of failed transfers, scale-down through drain, idle and keep-alive expiry."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from router.replicas import State, Trigger
from router.scaling.actions import Kind, Load, Mutate, Reactivate, Revive
from router.scaling.timeline import read
from router.scheduler import ClusterScheduler
from router.types import ReplicaId
from router.weights import Method
from tests.helpers.eventually import eventually_async
from tests.helpers.fake_replica import expected_tokens
from tests.helpers.router_core import collect, fake_cluster, request, run, tokens_of

P, D, INACTIVE = State.PREFILL, State.DECODE, State.INACTIVE
# rounds only by hand; the speeds the planner starts from
MANUAL: dict[str, Any] = {"plan_interval": 1000.0, "prefill_tokens_per_s": 100.0,
                          "migration_tokens_per_s": 1000.0}


def states(sched: ClusterScheduler) -> list[State]:
    return [h.state.role for h in sched.replicas.values()]


async def finish_round(sched: ClusterScheduler) -> list[object]:
    """One planning round; waits for the actions it started."""
    _, actions = sched.scaling.round()
    await asyncio.gather(*list(sched.scaling.tasks))
    return list(actions)


def burst(sched: ClusterScheduler, tokens: int) -> None:
    """Prompt tokens arriving now (what the planner's prefill band reads)."""
    sched.rates.arrived(tokens, sched.clock())


def test_a_burst_scales_prefill_up_by_chain_multicast_from_the_decode_replica(tmp_path: Path) -> None:
    async def body() -> None:
        timeline = tmp_path / "timeline.jsonl"
        async with fake_cluster((P, D, INACTIVE, INACTIVE), scaling="multicast", max_prefill=3,
                                timeline=timeline, **MANUAL) as (sched, fakes):
            burst(sched, 10_000)  # 2000 tokens/s for 5 s against 100 tokens/s per replica
            [load] = await finish_round(sched)
            assert load == Load(Method.CHAIN, (ReplicaId(1),), (ReplicaId(2), ReplicaId(3)), Kind.PREFILL)
            assert states(sched) == [P, D, P, P]
            assert "RdmaBroadcast" in fakes[1].calls and "RdmaBroadcast" not in fakes[0].calls
            assert all(f.param_op == "" for f in fakes)  # every background part joined
            events = await collect(sched.submit(request([5, 6], 4)))
            assert tokens_of(events) == expected_tokens([5, 6], 4)
        kinds = [r["kind"] for r in read(timeline)]
        assert "plan" in kinds and "transfer" in kinds
        records = read(timeline)
        moves = [(r["replica"], r["source"], r["target"]) for r in records if r["kind"] == "transition"]
        assert (2, "inactive", "loading_prefill") in moves and (2, "loading_prefill", "prefill") in moves
    run(body())


def test_tanz_from_two_decode_replicas_and_load_from_disk_without_sources() -> None:
    async def body() -> None:
        async with fake_cluster((P, D, D, INACTIVE, INACTIVE), scaling="multicast", max_prefill=3,
                                min_decode=2, **MANUAL) as (sched, fakes):
            burst(sched, 10_000)
            [load] = await finish_round(sched)
            assert load.method is Method.TANZ and set(load.sources) == {1, 2}  # type: ignore[attr-defined]
            assert states(sched) == [P, D, D, P, P]
            assert all("TanzBroadcast" in f.calls for f in fakes[1:])
        async with fake_cluster((INACTIVE, INACTIVE), scaling="multicast", max_prefill=1,
                                **MANUAL) as (sched, _fakes):
            burst(sched, 1_000)
            actions = await finish_round(sched)
            assert [a.method for a in actions] == [Method.LOAD_DISK, Method.LOAD_DISK]  # type: ignore[attr-defined]
            assert sorted(states(sched), key=lambda s: s.value) == [D, P]
    run(body())


def test_a_failed_transfer_rolls_back_and_a_later_round_succeeds() -> None:
    async def body() -> None:
        async with fake_cluster((P, D, INACTIVE), scaling="multicast", max_prefill=2,
                                **MANUAL) as (sched, fakes):
            fakes[2].fail["RecvParams"] = grpc.StatusCode.INTERNAL
            burst(sched, 10_000)
            [load] = await finish_round(sched)
            assert load.method is Method.P2P  # type: ignore[attr-defined]
            assert states(sched) == [P, D, INACTIVE]  # target back to inactive, source serving
            assert all(f.param_op == "" for f in fakes)  # nothing held
            assert sched.metrics.registry.get_sample_value(
                "pdcluster_scaling_actions_total", {"action": "load", "outcome": "failed"}) == 1
            await finish_round(sched)
            assert states(sched) == [P, D, P]
    run(body())


def test_a_target_killed_during_a_scale_up_is_dead_and_requests_still_finish() -> None:
    async def body() -> None:
        async with fake_cluster((P, D, INACTIVE, INACTIVE), scaling="multicast", max_prefill=3,
                                **MANUAL) as (sched, fakes):
            for fake in fakes[2:]:
                fake.param_delay = 0.3
            burst(sched, 10_000)
            sched.scaling.round()
            pending = [asyncio.create_task(collect(sched.submit(request([i, i + 1], 6)))) for i in range(4)]
            await eventually_async(lambda: "RdmaBroadcast" in fakes[3].calls)
            await fakes[3].stop()
            await asyncio.gather(*list(sched.scaling.tasks))
            for i, task in enumerate(pending):
                assert tokens_of(await task) == expected_tokens([i, i + 1], 6)
            assert states(sched)[3] is State.DEAD
            assert states(sched)[2] in (INACTIVE, P)
            assert states(sched)[:2] == [P, D]
    run(body())


def test_idle_cluster_drains_one_replica_per_round_then_expires_it_after_the_keep_alive() -> None:
    async def body() -> None:
        async with fake_cluster((P, D, D, D), scaling="multicast", keep_alive=0.2, decode_lower=0.3,
                                **MANUAL) as (sched, fakes):
            await finish_round(sched)
            assert states(sched).count(State.DRAINING_DECODE) + states(sched).count(State.IDLE) == 1
            await eventually_async(lambda: State.IDLE in states(sched))
            await finish_round(sched)  # the next round: one more down
            await eventually_async(lambda: states(sched).count(State.IDLE) == 2)
            await asyncio.sleep(0.25)
            await finish_round(sched)  # keep-alive over: the first idle one is reset
            assert states(sched).count(INACTIVE) == 1
            reset = [f for f in fakes if "ResetStatus" in f.calls]
            assert len(reset) == 1 and not reset[0].loaded
            assert states(sched)[0] is P and states(sched).count(D) == 1  # never below the minimum
    run(body())


def test_revive_reactivate_and_mutate_move_no_weights() -> None:
    async def body() -> None:
        async with fake_cluster((P, P, D, D), scaling="multicast", **MANUAL) as (sched, fakes):
            ex = sched.scaling.executor
            sched.replicas[ReplicaId(3)].state.move(State.DRAINING_DECODE, Trigger.DRAIN)
            assert await ex.run(Revive(ReplicaId(3), Kind.DECODE))
            assert await ex.run(Mutate(ReplicaId(1)))
            assert states(sched) == [P, D, D, D]
            for rid in (2, 3):
                sched.replicas[ReplicaId(rid)].state.move(State.DRAINING_DECODE, Trigger.DRAIN)
            await eventually_async(lambda: states(sched)[2:] == [State.IDLE, State.IDLE])
            assert await ex.run(Reactivate(ReplicaId(2), Kind.PREFILL))
            assert states(sched)[2] is P
            assert not any(c in f.calls for f in fakes for c in ("SendParams", "RdmaBroadcast", "LoadParams"))
            events = await collect(sched.submit(request([7], 3)))
            assert tokens_of(events) == expected_tokens([7], 3)
    run(body())


def test_static_policy_never_plans_and_the_policy_switches_at_run_time() -> None:
    async def body() -> None:
        async with fake_cluster((P, D, INACTIVE), plan_interval=0.02, prefill_tokens_per_s=100.0
                                ) as (sched, _fakes):
            burst(sched, 10_000)
            await asyncio.sleep(0.2)
            assert states(sched) == [P, D, INACTIVE] and sched.scaling.policy.name == "static"
            assert sched.scaling.set_policy("multicast") == "static"
            burst(sched, 10_000)
            await eventually_async(lambda: states(sched)[2] is P)
    run(body())

