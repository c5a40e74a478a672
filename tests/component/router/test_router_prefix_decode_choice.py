"""Cache-aware routing picks the decode replica too (real replicas, tiny model, `recompute`: the decode
replica prefills prompt + first token again, from its own prefix cache where it holds the prompt):
a conversation's second turn decodes where its first turn did, though the other decode replica has
more free pages; under `--routing load` it goes to the one with more free pages."""

from __future__ import annotations

from pathlib import Path

import pytest

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
