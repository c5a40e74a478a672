"""The scheduling core end to end over fake replicas (exact call sequences, fault injection)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from router import strategies
from router.config import Strategy
from router.replicas import State
from tests.helpers.fake_replica import expected_tokens
from tests.helpers.router_core import collect, fake_cluster, finish_of, request, run, tokens_of

PD = (State.PREFILL, State.DECODE)


@pytest.mark.parametrize("strategy", strategies.names())
def test_every_strategy_generates_the_model_tokens_and_frees_pages(strategy: str) -> None:
    async def body() -> None:
        async with fake_cluster(PD, strategy) as (sched, fakes):
            prompts = [[5 + i] * (3 + i) for i in range(6)]
            results = await asyncio.gather(*(collect(sched.submit(request(p, 6 + i)))
                                             for i, p in enumerate(prompts)))
            for i, (p, events) in enumerate(zip(prompts, results, strict=True)):
                assert tokens_of(events) == expected_tokens(p, 6 + i)
                fin = finish_of(events)
                assert fin.generated_tokens == 6 + i
                assert fin.route.strategy
            await asyncio.sleep(0.05)
            assert [f.free for f in fakes] == [f.num_blocks for f in fakes]
    run(body())


def test_full_migration_route_and_call_sequence() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, (p, d)):
            events = await collect(sched.submit(request([1, 2, 3], 4)))
            route = finish_of(events).route
            assert (route.prefill_replica, route.decode_replica, route.strategy) == (0, 1, "full")
            assert route.migration_bytes == 16 * 8  # one page of 16 tokens, 8 bytes per token
            # (each replica was cleared once when it joined: whatever it held was nobody's)
            assert [c for c in p.calls if c != "Info"] == ["ClearCache", "PrefillV2", "Migrate"]
            assert [c for c in d.calls if c != "Info"][:3] == ["ClearCache", "Immigrate", "DecodeV2"]
    run(body())


def test_route_migration_bytes_count_the_prompt_pages_that_move_not_the_reservation() -> None:
    """A 3-token prompt with 30 new tokens reserves 3 pages but a migration moves 1 (the prompt's):
    the route said 3 pages' bytes."""
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, _):
            events = await collect(sched.submit(request([1, 2, 3], 30)))
            assert finish_of(events).route.migration_bytes == 16 * 8  # one page of 16 tokens, 8 B each
    run(body())


def test_migration_unimplemented_falls_back_to_recompute() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, fakes):
            for f in fakes:
                f.migrate = False
            events = await collect(sched.submit(request([9, 9], 5)))
            assert tokens_of(events) == expected_tokens([9, 9], 5)
            route = finish_of(events).route
            assert (route.decode_replica, route.strategy) == (1, "recompute")
            await asyncio.sleep(0.05)
            assert [f.free for f in fakes] == [f.num_blocks for f in fakes]
    run(body())


def test_progressive_unimplemented_falls_back() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.PROGRESSIVE) as (sched, fakes):
            for f in fakes:
                f.migrate = False
            events = await collect(sched.submit(request([4, 4, 4], 5)))
            assert tokens_of(events) == expected_tokens([4, 4, 4], 5)
            await asyncio.sleep(0.05)
            assert [f.free for f in fakes] == [f.num_blocks for f in fakes]
    run(body())


@pytest.mark.parametrize("strategy", strategies.names())
def test_scarce_pages_requests_wait_and_all_complete(strategy: str) -> None:
    async def body() -> None:
        async with fake_cluster(PD, strategy, num_blocks=6) as (sched, fakes):
            prompts = [[20 + i] * 9 for i in range(12)]  # 9 + 12 tokens = 2 pages each: 3 at a time
            results = await asyncio.gather(*(collect(sched.submit(request(p, 12))) for p in prompts))
            for p, events in zip(prompts, results, strict=True):
                assert tokens_of(events) == expected_tokens(p, 12)
            await asyncio.sleep(0.05)
            assert [f.free for f in fakes] == [f.num_blocks for f in fakes]
    run(body(), timeout=30)


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
            await asyncio.sleep(0.05)
            assert [f.free for f in fakes] == [f.num_blocks for f in fakes]
    run(body(), timeout=30)


def test_truncate_keeps_the_last_prompt_tokens() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.RECOMPUTE) as (sched, _):
            long = [40 + i for i in range(600)]  # over the fake's 512 input limit before truncation
            req = dataclasses.replace(request(long, 5), truncate=8)
            events = await collect(sched.submit(req))
            assert tokens_of(events) == expected_tokens(long[-8:], 5)
            assert finish_of(events).prompt_tokens == 8
    run(body())


def test_a_snapshot_shows_roles_pages_and_the_queue() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL, num_blocks=6) as (sched, fakes):
            fakes[1].step_delay = 0.02
            tasks = [asyncio.create_task(collect(sched.submit(request([60 + i] * 9, 12)))) for i in range(5)]
            while "DecodeV2" not in fakes[1].calls:
                await asyncio.sleep(0.005)
            view = sched.snapshot()
            assert [(r.id, r.role) for r in view.replicas] == [(0, State.PREFILL), (1, State.DECODE)]
            assert view.replicas[1].used_blocks > 0 and view.replicas[1].requests > 0
            assert view.active_requests == 5 and view.strategy == "full"
            assert view.queued_prompt_tokens == 9 * view.queued_requests
            await asyncio.gather(*tasks)
            done = sched.snapshot()
            assert (done.active_requests, done.queued_requests, done.queued_prompt_tokens) == (0, 0, 0)
    run(body())
