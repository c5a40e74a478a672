"""Cache-aware routing over real replicas (tiny model, prefix cache on): the second turn of a
conversation goes to the replica holding its first turn's pages, which takes them from its cache
(`cached_tokens` in the route and in the hit-rate metric); under `--routing load` a second turn
gets a cached prefix only where it happens to land on that replica. Tokens equal transformers.

The decode replica is picked the same way (`recompute`: the decode replica prefills prompt + first
token again, from its own prefix cache where it holds the prompt): a second turn decodes where its
first turn did, though the other decode replica has more free pages; under `--routing load` it goes
to the one with more free pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import Strategy
from router.main import kv_bytes_per_token
from router.replicas import State
from router.types import TokenEvent
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

BLOCK = 16  # the real replicas' page size


@pytest.mark.parametrize("routing", ["cache-aware", "load"])
def test_second_turn_goes_to_the_replica_holding_its_prefix(routing: str, tiny_llama: Path,
                                                            tmp_path: Path) -> None:
    want = greedy(tiny_llama)

    async def body() -> None:
        roles = (State.COLOCATED, State.COLOCATED)
        async with real_cluster(tiny_llama, tmp_path, roles, Strategy.COLOCATED,
                                routing=routing) as (sched, replicas):
            prompt_tokens = hit_tokens = 0
            for conv in range(3):  # three conversations: a lucky pick passes one, not three
                turn1 = [3 + (i * 7 + conv * 13) % 50 for i in range(2 * BLOCK + 8)]  # 2 pages + a part
                first = await collect(sched.submit(request(turn1, 6)))
                home = finish_of(first).route.prefill_replica
                assert finish_of(first).route.cached_tokens == 0
                turn2 = turn1 + tokens_of(first) + [11, 12, 13, 14]
                second = await collect(sched.submit(request(turn2, 6)))
                assert tokens_of(second) == want(turn2, 6)
                route = finish_of(second).route
                if routing == "cache-aware":
                    assert (route.prefill_replica, route.cached_tokens) == (home, 2 * BLOCK)
                else:
                    assert route.cached_tokens == (2 * BLOCK if route.prefill_replica == home else 0)
                prompt_tokens += len(turn1) + len(turn2)
                hit_tokens += route.cached_tokens
            await pages_back(replicas)
            assert sched.metrics.prefix_hit_rate._value.get() == (
                pytest.approx(hit_tokens / prompt_tokens))
            assert hit_tokens > 0 or routing == "load"
    run(body())


@pytest.mark.parametrize("routing", ["cache-aware", "load"])
def test_second_turn_decodes_on_the_replica_holding_its_prefix(routing: str, tiny_llama: Path,
                                                               tmp_path: Path) -> None:
    want = greedy(tiny_llama)

    async def body() -> None:
        roles = (State.PREFILL, State.DECODE, State.DECODE)
        async with real_cluster(tiny_llama, tmp_path, roles, "recompute",
                                routing=routing) as (sched, replicas):
            turn1 = [3 + (i * 5) % 40 for i in range(2 * BLOCK + 8)]
            first = await collect(sched.submit(request(turn1, 6)))
            home = finish_of(first).route.decode_replica  # equal free pages: the lowest id
            assert home == 1
            # a long request sharing turn 1's pages decodes on home too (its prefix, or the tie):
            # home then has fewer free pages than the other decode replica
            busy = sched.submit(request([*turn1[: 2 * BLOCK], 9, 9, 9], 80, ignore_eos=True))
            async for event in busy:
                if isinstance(event, TokenEvent):
                    break
            turn2 = turn1 + tokens_of(first) + [11, 12, 13, 14]
            second = await collect(sched.submit(request(turn2, 6)))
            assert tokens_of(second) == want(turn2, 6)
            route = finish_of(second).route
            assert route.cached_tokens == 2 * BLOCK  # the prefill replica's own cache
            assert route.decode_replica == (home if routing == "cache-aware" else 2)
            await collect(busy)
            await pages_back(replicas)
    run(body())


def test_second_turn_migrates_only_the_pages_the_decode_replica_lacks(tiny_llama: Path,
                                                                      tmp_path: Path) -> None:
    want = greedy(tiny_llama)
    page_bytes = BLOCK * kv_bytes_per_token(tiny_llama, "float32")

    async def body() -> None:
        roles = (State.PREFILL, State.DECODE)
        async with real_cluster(tiny_llama, tmp_path, roles, Strategy.FULL) as (sched, replicas):
            turn1 = [3 + (i * 11) % 45 for i in range(2 * BLOCK + 8)]  # 2 full pages + 8 tokens
            first = await collect(sched.submit(request(turn1, 6)))
            assert finish_of(first).route.migration_bytes == 3 * page_bytes
            turn2 = turn1 + tokens_of(first) + [11, 12, 13, 14]  # 50 tokens: 4 pages, 2 held on D
            second = await collect(sched.submit(request(turn2, 6)))
            assert tokens_of(second) == want(turn2, 6)
            assert finish_of(second).route.migration_bytes == 2 * page_bytes
            await pages_back(replicas)
    run(body())
