"""The autoscaler in this process: rounds driven by hand (a long plan interval), the executor's
methods (chain multicast, Tanz, load from disk, revive, reactivate, mutate), scale-down through
drain, idle and keep-alive expiry over real replicas (tiny model); rollback of a failed transfer
and a target killed mid scale-up over fake replicas (injected failure, slowed transfer)."""

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
from tests.helpers.router_core import collect, fake_cluster, greedy, real_cluster, request, run, tokens_of

P, D, INACTIVE = State.PREFILL, State.DECODE, State.INACTIVE
# rounds only by hand; the speeds the planner starts from
MANUAL: dict[str, Any] = {"plan_interval": 1000.0, "prefill_tokens_per_s": 100.0,
                          "migration_tokens_per_s": 1000.0}
# in-process real replicas share the test's interpreter: on two loaded cores a weight load can hold off
# their Info answers past the default 5 s heartbeat deadline, which these tests are not about
REAL: dict[str, Any] = {**MANUAL, "heartbeat_timeout": 30.0}


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


def test_a_burst_scales_prefill_up_by_chain_multicast_from_the_decode_replica(tiny_llama: Path,
                                                                              tmp_path: Path) -> None:
    async def body() -> None:
        timeline = tmp_path / "timeline.jsonl"
        async with real_cluster(tiny_llama, tmp_path, (P, D, INACTIVE, INACTIVE), scaling="multicast",
                                max_prefill=3, timeline=timeline, **REAL) as (sched, replicas):
            burst(sched, 10_000)  # 2000 tokens/s for 5 s against 100 tokens/s per replica
            [load] = await finish_round(sched)
            assert load == Load(Method.CHAIN, (ReplicaId(1),), (ReplicaId(2), ReplicaId(3)), Kind.PREFILL)
            assert states(sched) == [P, D, P, P]
            calls = [r.calls for r in replicas]
            assert "RdmaBroadcast" in calls[1] and "RdmaBroadcast" not in calls[0]
            # every background part joined
            assert [c.count("RdmaBroadcast") for c in calls] == [c.count("WaitRdmaDone") for c in calls]
            events = await collect(sched.submit(request([5, 6], 4)))
            assert tokens_of(events) == greedy(tiny_llama)([5, 6], 4)
        kinds = [r["kind"] for r in read(timeline)]
        assert "plan" in kinds and "transfer" in kinds
        records = read(timeline)
        moves = [(r["replica"], r["source"], r["target"]) for r in records if r["kind"] == "transition"]
        assert (2, "inactive", "loading_prefill") in moves and (2, "loading_prefill", "prefill") in moves
    run(body())


def test_tanz_from_two_decode_replicas_and_load_from_disk_without_sources(tiny_llama: Path,
                                                                          tmp_path: Path) -> None:
    async def body() -> None:
        roles = (P, D, D, INACTIVE, INACTIVE)
        async with real_cluster(tiny_llama, tmp_path / "tanz", roles, scaling="multicast", max_prefill=3,
                                min_decode=2, **REAL) as (sched, replicas):
            burst(sched, 10_000)
            [load] = await finish_round(sched)
            assert load.method is Method.TANZ and set(load.sources) == {1, 2}  # type: ignore[attr-defined]
            assert states(sched) == [P, D, D, P, P]
            assert all("TanzBroadcast" in r.calls for r in replicas[1:])
        async with real_cluster(tiny_llama, tmp_path / "disk", (INACTIVE, INACTIVE), scaling="multicast",
                                max_prefill=1, **REAL) as (sched, _):
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
            assert sched.metrics.total(
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


def test_idle_cluster_drains_one_replica_per_round_then_expires_it_after_the_keep_alive(
        tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, (P, D, D, D), scaling="multicast", keep_alive=0.2,
                                decode_lower=0.3, **REAL) as (sched, replicas):
            await finish_round(sched)
            assert states(sched).count(State.DRAINING_DECODE) + states(sched).count(State.IDLE) == 1
            await eventually_async(lambda: State.IDLE in states(sched))
            await finish_round(sched)  # the next round: one more down
            await eventually_async(lambda: states(sched).count(State.IDLE) == 2)
            await asyncio.sleep(0.25)  # the behaviour under test: the keep-alive (0.2 s) runs out
            await finish_round(sched)  # keep-alive over: the first idle one is reset
            assert states(sched).count(INACTIVE) == 1
            reset = [r for r in replicas if "ResetStatus" in r.calls]
            assert len(reset) == 1 and await asyncio.to_thread(reset[0].replica.health) == "inactive"
            assert states(sched)[0] is P and states(sched).count(D) == 1  # never below the minimum
    run(body())


def test_revive_reactivate_and_mutate_move_no_weights(tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, (P, P, D, D), scaling="multicast",
                                **REAL) as (sched, replicas):
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
            moves = ("SendParams", "RdmaBroadcast", "LoadParams")
            assert not any(c in r.calls for r in replicas for c in moves)
            events = await collect(sched.submit(request([7], 3)))
            assert tokens_of(events) == greedy(tiny_llama)([7], 3)
    run(body())


def test_static_policy_never_plans_and_the_policy_switches_at_run_time(tiny_llama: Path,
                                                                       tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, (P, D, INACTIVE), plan_interval=0.02,
                                prefill_tokens_per_s=100.0) as (sched, _):
            burst(sched, 10_000)
            await asyncio.sleep(0.2)  # the behaviour under test: ten plan intervals pass, nothing happens
            assert states(sched) == [P, D, INACTIVE] and sched.scaling.policy.name == "static"
            assert sched.scaling.set_policy("multicast") == "static"
            burst(sched, 10_000)
            await eventually_async(lambda: states(sched)[2] is P)
    run(body())



def test_an_arrival_that_outruns_the_prefill_replicas_is_planned_for_at_once(tmp_path: Path) -> None:
    async def body() -> None:
        timeline = tmp_path / "timeline.jsonl"
        async with fake_cluster((P, D, INACTIVE), scaling="multicast", max_prefill=2, ttft_slo=1.0,
                                timeline=timeline, **MANUAL) as (sched, _fakes):
            # before any prefill is measured, the speed is MANUAL's 100 tokens/s
            first = asyncio.create_task(collect(sched.submit(request([4] * 20, 2))))  # 40 tokens/s
            assert sched.scaling.urgent_rounds == 0
            # 60 more prompt tokens in the 0.5 s surge window: 160 tokens/s > 100
            second = asyncio.create_task(collect(sched.submit(request([5] * 60, 2))))
            assert sched.scaling.urgent_rounds == 1  # planned in submit, not at the 1000 s interval
            await asyncio.gather(*list(sched.scaling.tasks))
            assert states(sched) == [P, D, P]
            assert tokens_of(await first) == expected_tokens([4] * 20, 2)
            assert tokens_of(await second) == expected_tokens([5] * 60, 2)
        [urgent] = [r for r in read(timeline) if r["kind"] == "plan"]
        assert str(urgent["reason"]).startswith("arrival surge") and urgent["actions"]
    run(body())


def test_a_decode_bound_burst_scales_decode_up_once_and_back_after_it(tmp_path: Path) -> None:
    """Short prompts, long outputs, decode steps over the TPOT SLO: decode scales up once, stays up
    through the burst (no down and up again), and goes back to one replica once the burst is over."""
    async def body() -> None:
        timeline = tmp_path / "timeline.jsonl"
        async with fake_cluster((P, D, INACTIVE), scaling="multicast", tpot_slo=0.03, max_prefill=1,
                                max_decode=2, plan_interval=0.1, cooldown=0.5, keep_alive=100.0,
                                prefill_tokens_per_s=1e6, migration_tokens_per_s=1e6,
                                timeline=timeline) as (sched, fakes):
            for fake in fakes[1:]:
                fake.step_delay = 0.05  # 50 ms per decode step against a 30 ms SLO
            prompts = [[wave + 1, i + 1] for wave in range(4) for i in range(3)]
            tasks = []
            for wave in range(4):
                tasks += [asyncio.create_task(collect(sched.submit(request(p, 30))))
                          for p in prompts[3 * wave:3 * wave + 3]]
                await asyncio.sleep(0.6)
            results = await asyncio.gather(*tasks)
            assert [tokens_of(r) for r in results] == [expected_tokens(p, 30) for p in prompts]
            assert states(sched) == [P, D, D]  # still up when the burst ends
            await eventually_async(lambda: states(sched).count(D) == 1, timeout=10.0)
        plans = [r for r in read(timeline) if r["kind"] == "plan" and r["actions"]]
        actions = [(a["action"], a.get("kind")) for r in plans for a in r["actions"]]
        assert actions == [("load", "decode"), ("drain", None)]
        assert float(plans[0]["loads"]["decode_tpot_s"]) > 0.03
    run(body())


def test_a_host_cache_miss_loads_from_disk_instead() -> None:
    async def body() -> None:
        async with fake_cluster((P, D, INACTIVE), scaling="host-cache", max_prefill=2, model=Path("/m/tiny"),
                                **MANUAL) as (sched, fakes):
            assert not fakes[2].weights.host_copy  # the node's host cache does not hold the model
            burst(sched, 10_000)
            [load] = await finish_round(sched)
            assert load.method is Method.LOAD_HOST  # type: ignore[attr-defined]
            assert states(sched) == [P, D, P]
            assert fakes[2].calls.count("LoadParams") == 2  # the miss, then from the model root
            events = await collect(sched.submit(request([7, 8], 3)))
            assert tokens_of(events) == expected_tokens([7, 8], 3)
    run(body())
