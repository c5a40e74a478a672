"""The scheduling core end to end over real replicas in this process (tiny model): every strategy's
tokens equal transformers' greedy ones, routes and call sequences, pages exact, scarce pages,
truncation and limits, a client that leaves. Faults are injected over fake replicas
(test_router_core_faults.py, test_router_core_fake_replicas.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from router import strategies
from router.config import Strategy
from router.replicas import State
from router.types import ReplicaId, RequestRejected, TokenEvent
from tests.helpers.router_core import (
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


def without_info(calls: list[str]) -> list[str]:
    """The calls other than the router's background ones (Info polls, ConnectPeers when one joins)."""
    return [c for c in calls if c not in ("Info", "ConnectPeers")]


@pytest.mark.parametrize("strategy", strategies.names())
def test_every_strategy_generates_the_model_tokens_and_frees_pages(strategy: str, tiny_llama: Path,
                                                                   tmp_path: Path) -> None:
    want = greedy(tiny_llama)

    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, strategy) as (sched, replicas):
            prompts = [[5 + i] * (3 + i) for i in range(6)]
            results = await asyncio.gather(*(collect(sched.submit(request(p, 6 + i)))
                                             for i, p in enumerate(prompts)))
            for i, (p, events) in enumerate(zip(prompts, results, strict=True)):
                assert tokens_of(events) == want(p, 6 + i)
                fin = finish_of(events)
                assert fin.generated_tokens == len(want(p, 6 + i))
                assert fin.route.strategy
            await pages_back(replicas)
    run(body())


def test_full_migration_route_call_sequence_and_the_bytes_of_the_prompt_pages(tiny_llama: Path,
                                                                               tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.FULL) as (sched, (p, d)):
            # 3 prompt tokens + 30 new reserve 3 pages, but a migration moves the prompt's one page
            events = await collect(sched.submit(request([1, 2, 3], 30)))
            route = finish_of(events).route
            assert (route.prefill_replica, route.decode_replica, route.strategy) == (0, 1, "full")
            assert route.migration_bytes == 16 * sched.kv_bytes_per_token
            # (each replica was cleared once when it joined: whatever it held was nobody's)
            assert without_info(p.calls) == ["ClearCache", "PrefillV2", "Migrate"]
            assert without_info(d.calls)[:3] == ["ClearCache", "Immigrate", "DecodeV2"]
    run(body())


@pytest.mark.parametrize("strategy", strategies.names())
def test_scarce_pages_requests_wait_and_all_complete(strategy: str, tiny_llama: Path, tmp_path: Path) -> None:
    want = greedy(tiny_llama)

    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, strategy, num_blocks=6) as (sched, replicas):
            prompts = [[20 + i] * 9 for i in range(12)]  # 9 + 12 tokens = 2 pages each: 3 at a time
            results = await asyncio.gather(*(collect(sched.submit(request(p, 12))) for p in prompts))
            for p, events in zip(prompts, results, strict=True):
                assert tokens_of(events) == want(p, 12)
            await pages_back(replicas)
    run(body())


def test_truncate_keeps_the_last_prompt_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.RECOMPUTE) as (sched, _):
            long = [40 + i % 400 for i in range(600)]  # over the replicas' 511 input tokens before truncation
            events = await collect(sched.submit(dataclasses.replace(request(long, 5), truncate=8)))
            assert tokens_of(events) == greedy(tiny_llama)(long[-8:], 5)
            assert finish_of(events).prompt_tokens == 8
    run(body())


def test_request_over_the_limits_is_rejected_before_queueing(tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.FULL) as (sched, _):
            for prompt, new in [([1] * 600, 1), ([1] * 10, 1020), ([], 3)]:
                with pytest.raises(RequestRejected) as refused:
                    sched.submit(request(prompt, new))
                assert refused.value.http_status == 400
            assert len(sched.queue) == 0 and not sched.requests
    run(body())


def test_client_disconnect_mid_stream_frees_pages(tiny_llama: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.FULL) as (sched, replicas):
            stream = sched.submit(request([3, 1, 4], 400, ignore_eos=True))
            seen = 0
            async for event in stream:
                seen += isinstance(event, TokenEvent)
                if seen == 3:
                    break
            await stream.aclose()
            await pages_back(replicas)
            # the batch was filtered or cleared (one ClearCache is the join's)
            decode = replicas[1].calls
            assert "FilterBatch" in decode or decode.count("ClearCache") > 1
            assert not sched.requests
    run(body())


def test_batch_waiting_for_a_destination_is_freed_when_its_clients_leave(tiny_llama: Path,
                                                                         tmp_path: Path) -> None:
    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, PD, Strategy.FULL) as (sched, (p, d)):
            sched.replicas[ReplicaId(1)].state.promised = 10_000  # no room on the decode replica
            stream = sched.submit(request([9, 8, 7], 20, ignore_eos=True))
            async for event in stream:
                if isinstance(event, TokenEvent):
                    break
            total, free = await p.pages()
            assert free < total
            await stream.aclose()
            await pages_back([p, d])
            # cleared at the join, then this batch
            assert p.calls.count("ClearCache") == 2 and "Migrate" not in p.calls
            assert not sched.replicas[ReplicaId(0)].state.held
    run(body())
