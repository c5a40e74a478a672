"""Chunked prefill in a colocated router (issue 25 item 4) over a real replica of the tiny model:
a prompt longer than `--prefill-chunk-tokens` is prefilled a chunk per loop step (PrefillV2 with
`chunk_tokens`, then PrefillChunk calls) with the running request's decode steps between the chunks;
both requests' tokens equal transformers and every page comes back. `--no-chunked-prefill` prefills
it in one call."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import Strategy
from router.replicas import State
from router.types import TokenEvent
from tests.helpers.router_core import collect, greedy, pages_back, real_cluster, request, run, tokens_of

CHUNK = 16
LONG_RUN = 400  # the running request's new tokens: it still decodes while the long prompt is prefilled


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(chunked: bool, tiny_llama: Path,
                                                                   tmp_path: Path) -> None:
    want = greedy(tiny_llama)

    async def body() -> None:
        async with real_cluster(tiny_llama, tmp_path, (State.COLOCATED,), Strategy.COLOCATED,
                                prefill_chunk_tokens=CHUNK, chunked_prefill=chunked) as (sched, replicas):
            calls = replicas[0].calls
            short = [5, 6, 7, 8]
            running = sched.submit(request(short, LONG_RUN, ignore_eos=True))
            got_short: list[int] = []
            async for event in running:  # the short request decodes before the long one arrives
                if isinstance(event, TokenEvent):
                    got_short.append(event.token.id)
                    break
            calls.clear()
            long_prompt = [3 + (i * 7) % 50 for i in range(4 * CHUNK + 5)]
            long_events = await collect(sched.submit(request(long_prompt, 4)))
            rest = await collect(running)
            assert tokens_of(long_events) == want(long_prompt, 4)
            assert got_short + tokens_of(rest) == want(short, LONG_RUN, ignore_eos=True)
            chunks = calls.count("PrefillChunk")
            if chunked:
                assert chunks == 4  # 69 tokens in 16-token chunks: 16 + 16 + 16 + 16, then 5 with sampling
                first, last = calls.index("PrefillV2"), len(calls) - 1 - calls[::-1].index("PrefillChunk")
                between = calls[first:last]
                assert between.count("DecodeV2") >= chunks  # a decode step between every two chunks
            else:
                assert chunks == 0
            await pages_back(replicas)
    run(body())
