"""The scheduling core over fake replicas, for what only the fake can inject: migration RPCs that
are not implemented, slow immigrations and prefills (to see how many run at once), requests held in
flight for a snapshot. Everything else runs over real replicas (test_router_core_real_replicas.py)."""

from __future__ import annotations

import asyncio

import pytest

from router.config import Strategy
from router.replicas import State
from tests.helpers.eventually import eventually_async
from tests.helpers.fake_replica import expected_tokens
from tests.helpers.router_core import collect, fake_cluster, finish_of, pages_back, request, run, tokens_of

PD = (State.PREFILL, State.DECODE)


def test_migration_unimplemented_falls_back_to_recompute() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, fakes):
            for f in fakes:
                f.migrate = False
            events = await collect(sched.submit(request([9, 9], 5)))
            assert tokens_of(events) == expected_tokens([9, 9], 5)
            route = finish_of(events).route
            assert (route.decode_replica, route.strategy) == (1, "recompute")
            await pages_back(fakes)
    run(body())


def test_progressive_unimplemented_falls_back() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.PROGRESSIVE) as (sched, fakes):
            for f in fakes:
                f.migrate = False
            events = await collect(sched.submit(request([4, 4, 4], 5)))
            assert tokens_of(events) == expected_tokens([4, 4, 4], 5)
            await pages_back(fakes)
    run(body())


@pytest.mark.parametrize("bound", [1, 2])
def test_inbound_migrations_per_decode_replica_are_bounded(bound: int) -> None:
    async def body() -> None:
        roles = (State.PREFILL, State.PREFILL, State.PREFILL, State.DECODE)
        async with fake_cluster(roles, Strategy.FULL, max_inbound_migrations=bound,
                                max_batch_size=1) as (sched, fakes):
            fakes[3].immigrate_delay = 0.05
            prompts = [[30 + i] * 3 for i in range(9)]
            results = await asyncio.gather(*(collect(sched.submit(request(p, 4))) for p in prompts))
            for p, events in zip(prompts, results, strict=True):
                assert tokens_of(events) == expected_tokens(p, 4)
            assert fakes[3].calls.count("Immigrate") == 9
            assert fakes[3].max_immigrating == bound
    run(body(), timeout=30)


@pytest.mark.parametrize("pending", [1, 4])
def test_prefills_are_pipelined_within_the_pending_migration_bound(pending: int) -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL, max_batch_size=1,
                                max_pending_migrations=pending) as (sched, fakes):
            fakes[0].step_delay = 0.05
            prompts = [[40 + i] * 3 for i in range(6)]
            results = await asyncio.gather(*(collect(sched.submit(request(p, 4))) for p in prompts))
            for p, events in zip(prompts, results, strict=True):
                assert tokens_of(events) == expected_tokens(p, 4)
            assert fakes[0].calls.count("PrefillV2") == 6
            # PREFILL_DEPTH prefills on the wire at once, never more than may wait for a migration
            assert fakes[0].max_prefilling == min(pending, 2)
            await pages_back(fakes)
    run(body(), timeout=30)


def test_a_snapshot_shows_roles_pages_and_the_queue() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL, num_blocks=6) as (sched, fakes):
            fakes[1].step_delay = 0.02
            tasks = [asyncio.create_task(collect(sched.submit(request([60 + i] * 9, 12)))) for i in range(5)]
            await eventually_async(lambda: "DecodeV2" in fakes[1].calls)
            view = sched.snapshot()
            assert [(r.id, r.role) for r in view.replicas] == [(0, State.PREFILL), (1, State.DECODE)]
            assert view.replicas[1].used_blocks > 0 and view.replicas[1].requests > 0
            assert view.active_requests == 5 and view.strategy == "full"
            assert view.queued_prompt_tokens == 9 * view.queued_requests
            await asyncio.gather(*tasks)
            done = sched.snapshot()
            assert (done.active_requests, done.queued_requests, done.queued_prompt_tokens) == (0, 0, 0)
    run(body())
