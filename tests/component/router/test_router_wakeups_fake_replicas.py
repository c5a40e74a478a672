"""Every wake path of the scheduler, with the loops' safety timeout raised past the test's deadline:
an idle loop or a waiting hand-off that no change woke would sleep through the test and fail it.

| scenario                                   | the wake-ups it needs                                   |
|--------------------------------------------|---------------------------------------------------------|
| idle replicas, then a request              | the queue wakes P; a migration's arrival wakes D         |
| pages short on P and on D                  | pages freed on D wake the hand-offs; on P, its loop      |
| one inbound migration at a time            | a reservation's end wakes the hand-offs waiting for D    |
| one pending migration per prefill replica  | a hand-off's end wakes its prefill loop                  |
| prefill replica dies                       | the change of roles wakes the decode replica's loop      |
| the strategy changes to colocated          | the change wakes every loop                              |
| a request fits only the second waiting loop | the first one woken hands the call on to it             |
"""

from __future__ import annotations

import asyncio

import pytest

from router import wakeup
from router.config import Strategy
from router.replicas import State
from router.scheduler import ClusterScheduler
from router.types import ReplicaId
from tests.helpers.fake_replica import expected_tokens
from tests.helpers.router_core import collect, fake_cluster, pages_back, request, run, tokens_of

PD = (State.PREFILL, State.DECODE)
DEADLINE_S = 20


@pytest.fixture(autouse=True)
def no_safety_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop woken only by its periodic look would miss the test's deadline."""
    monkeypatch.setattr(wakeup, "SAFETY_TIMEOUT_S", 3600.0)


async def serve(sched: ClusterScheduler, prompts: list[list[int]], max_new: int) -> None:
    """Submit every prompt at once and check each request's tokens."""
    results = await asyncio.gather(*(collect(sched.submit(request(p, max_new))) for p in prompts))
    for p, events in zip(prompts, results, strict=True):
        assert tokens_of(events) == expected_tokens(p, max_new)


def test_idle_loops_wake_for_a_request_and_for_its_migrated_batch() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, fakes):
            await asyncio.sleep(0.1)  # both loops asleep
            for i in range(3):
                await serve(sched, [[20 + i] * 3], 5)
                await asyncio.sleep(0.05)
            await pages_back(fakes)
    run(body(), timeout=DEADLINE_S)


def test_batches_waiting_for_pages_on_the_prefill_and_the_decode_replica() -> None:
    async def body() -> None:
        # 2 pages a request, 4 on each replica: P holds two prefilled batches, D decodes two at once
        async with fake_cluster(PD, Strategy.FULL, num_blocks=4, max_batch_size=1) as (sched, fakes):
            fakes[1].step_delay = 0.01
            await serve(sched, [[50 + i] * 3 for i in range(8)], 20)
            await pages_back(fakes)
    run(body(), timeout=DEADLINE_S)


def test_hand_offs_waiting_for_an_inbound_slot() -> None:
    async def body() -> None:
        roles = (State.PREFILL, State.PREFILL, State.PREFILL, State.DECODE)
        async with fake_cluster(roles, Strategy.FULL, max_inbound_migrations=1,
                                max_batch_size=1) as (sched, fakes):
            fakes[3].immigrate_delay = 0.02
            await serve(sched, [[30 + i] * 3 for i in range(6)], 4)
            assert fakes[3].max_immigrating == 1
            await pages_back(fakes)
    run(body(), timeout=DEADLINE_S)


def test_a_prefill_loop_waiting_for_its_pending_migrations() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL, max_batch_size=1,
                                max_pending_migrations=1) as (sched, fakes):
            fakes[1].immigrate_delay = 0.02
            await serve(sched, [[40 + i] * 3 for i in range(5)], 4)
            await pages_back(fakes)
    run(body(), timeout=DEADLINE_S)


def test_an_idle_decode_loop_takes_the_prefill_role_when_the_prefill_replica_dies() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, fakes):
            await asyncio.sleep(0.1)
            await fakes[0].stop()
            sched.mark_dead(ReplicaId(0), "stopped by the test")
            await serve(sched, [[60, 61, 62]], 5)
            assert sched.replicas[ReplicaId(1)].state.role is State.PREFILL
    run(body(), timeout=DEADLINE_S)


def test_idle_loops_wake_when_the_strategy_becomes_colocated() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, fakes):
            await asyncio.sleep(0.1)
            sched.set_strategy(Strategy.COLOCATED)
            await serve(sched, [[70 + i] * 3 for i in range(4)], 5)
            await pages_back(fakes)
    run(body(), timeout=DEADLINE_S)


def test_a_request_that_fits_only_a_later_waiting_loop_reaches_it() -> None:
    async def body() -> None:
        roles = (State.PREFILL, State.PREFILL, State.DECODE)
        async with fake_cluster(roles, Strategy.FULL) as (sched, fakes):
            await asyncio.sleep(0.1)  # both prefill loops found no batch, replica 0's first
            small = sched.replicas[ReplicaId(0)].state
            small.promised = small.free_blocks - 1  # as if a migration to it held all but one page
            await serve(sched, [[80, 81, 82]], 20)  # 2 pages: only replica 1 has them
            assert fakes[0].calls.count("PrefillV2") == 0
            assert fakes[1].calls.count("PrefillV2") == 1
    run(body(), timeout=DEADLINE_S)
