"""`n` > 1 (OpenAI): n samples of one prompt, answered as one object or one stream with each
choice's `index`.

Each sample is its own `GenerateRequest` (sample i seeded `seed + i` when the request has a seed,
so the n answers are reproducible; unseeded samples draw independently). All n are submitted before
any first event is awaited, so the scheduler sees them together and prefills them in one batch (the
replica's prefix cache then shares the prompt's pages). Answers: the choices in index order;
`usage` counts the prompt once and the completion tokens of every sample; a stream interleaves the
samples' chunks as they come, then one usage chunk (when asked) and one `[DONE]`.

Every feed is closed exactly once however the request ends (`FeedGroup.close`); a sample that fails
fails the whole request, as one request's failure would.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request

from router.http.common import backend_of
from router.http.errors import APIError, Flavor
from router.http.events import ClientGone, EventFeed, submit, unless_disconnected
from router.types import ErrorEvent, Event, GenerateRequest

SEED_LIMIT = 2**63  # the schema's seeds are below this


def sample_requests(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The n requests of n samples: sample i seeded `seed + i` (wrapping) when `req` has a seed."""
    seed = req.sampling.seed
    if seed is None:
        return [req] * n
    return [
        dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=(seed + i) % SEED_LIMIT))
        for i in range(n)
    ]


class FeedGroup:
    """The feeds of one request's samples, closed together (what `EventStreamResponse` closes)."""

    def __init__(self, feeds: Sequence[EventFeed]) -> None:
        self.feeds = list(feeds)

    async def close(self) -> None:
        """Close every sample's feed (each close is idempotent and shielded)."""
        for feed in self.feeds:
            await feed.close()


async def start_samples(
    request: Request, reqs: Sequence[GenerateRequest], flavor: Flavor
) -> tuple[FeedGroup, list[Event]]:
    """Submit every sample, then wait for each one's first event (`common.start` for n requests)."""
    backend = backend_of(request)
    group = FeedGroup([])
    try:
        for req in reqs:
            lease = backend.access.charge_tokens(request, req, flavor) if backend.access is not None else None
            try:
                group.feeds.append(submit(backend.scheduler, req, flavor, lease.observe if lease else None))
            except APIError:
                if lease is not None:
                    lease.refund()
                raise
        firsts: list[Event] = []
        for feed in group.feeds:
            first = await unless_disconnected(feed.next(), request.receive, feed)
            if first is None:
                raise APIError("the scheduler ended the request without an answer", 500, flavor)
            if isinstance(first, ErrorEvent):
                raise APIError(f"generation failed: {first.message}", max(first.http_status, 500), flavor)
            firsts.append(first)
    except (APIError, ClientGone, asyncio.CancelledError):
        await group.close()
        raise
    return group, firsts


def with_index(chunk: str, index: int) -> str:
    """An SSE chunk of sample 0's shape with its choice's `index` set (the formatter writes 0)."""
    return chunk.replace('"choices":[{"index":0', f'"choices":[{{"index":{index}', 1) if index else chunk


async def merged(streams: Sequence[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The samples' SSE chunks interleaved as they come (each sample's own order kept)."""
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[str]) -> None:
        try:
            async for chunk in stream:
                await queue.put(with_index(chunk, index))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            chunk = await queue.get()
            if chunk is None:
                running -= 1
            else:
                yield chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def summed_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One usage for n samples: the prompt once (its details too), every sample's completion tokens."""
    total = dict(usages[0])
    total["completion_tokens"] = sum(int(u["completion_tokens"]) for u in usages)
    total["total_tokens"] = int(total["prompt_tokens"]) + total["completion_tokens"]
    return total
