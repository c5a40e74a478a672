"""`router/chunked.py` on its own: which batches are chunked, the chunk calls, their pacing against
the running batch's decode steps (`--prefill-chunk-share`), a failed chunk, and a batch everybody
left. The replica is a stub answering "prefilling" until the last chunk."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

from router.batches import LiveBatch, Member
from router.chunked import ChunkedPrefill, needs_chunks
from router.errors import ReplicaCallError
from router.registry import ReplicaHandle
from router.types import BatchId, CachedBatch, GenerateRequest, RequestId, StepResult
from tests.helpers.router_core import request


@dataclass
class _State:
    id: RequestId
    wanted: bool = True
    on: list[str] = field(default_factory=list)

    def prefilling(self, replica: Any, from_queue: bool) -> None:
        self.on.append("prefilling")


@dataclass
class _Member:
    state: _State
    request: GenerateRequest

    @property
    def id(self) -> RequestId:
        return self.state.id

    @property
    def wanted(self) -> bool:
        return self.state.wanted


class _Client:
    def __init__(self, chunks: int, fail_at: int = -1) -> None:
        self.calls: list[str] = []
        self.left = chunks
        self.fail_at = fail_at

    async def prefill(self, spec: Any, chunk_tokens: int = 0) -> StepResult:
        return self._answer("PrefillV2")

    async def prefill_chunk(self, batch_id: BatchId, chunk_tokens: int) -> StepResult:
        return self._answer("PrefillChunk")

    async def clear_cache(self, batch_id: BatchId | None = None) -> None:
        self.calls.append("ClearCache")

    def _answer(self, name: str) -> StepResult:
        self.calls.append(name)
        if len(self.calls) - 1 == self.fail_at:
            raise ReplicaCallError("r", name, "INTERNAL", "boom")
        self.left -= 1
        batch = CachedBatch(BatchId(7), (RequestId(1),))
        generations: tuple[Any, ...] = () if self.left > 0 else (object(),)
        return StepResult(generations, batch)


@dataclass
class _ReplicaState:
    held: dict[RequestId, int] = field(default_factory=dict)

    def hold(self, pages: dict[RequestId, int]) -> None:
        self.held.update(pages)

    def release(self, ids: Any) -> None:
        for rid in list(ids):
            self.held.pop(rid, None)


@dataclass
class _Handle:
    client: _Client
    state: _ReplicaState = field(default_factory=_ReplicaState)
    block_size: int = 4
    id: int = 0
    running: object | None = None


def _setup(chunks: int, share: float, fail_at: int = -1) -> tuple[ChunkedPrefill, _Handle, list[str]]:
    handle = _Handle(_Client(chunks, fail_at))
    events: list[str] = []

    async def answered(members: list[Member], pages: dict[RequestId, int], result: StepResult,
                       seconds: float) -> LiveBatch | None:
        events.append("answered")
        return cast(LiveBatch, "live")

    def failed(exc: ReplicaCallError, members: list[Member]) -> None:
        events.append("failed")

    pages = lambda: events.append("pages")  # noqa: E731
    chunked = ChunkedPrefill(cast(ReplicaHandle, handle), 16, answered, failed, pages, share)
    return chunked, handle, events


def _busy(chunked: ChunkedPrefill) -> bool:  # (read afresh: mypy keeps a property narrowed)
    return chunked.busy


def _members(tokens: int = 40) -> list[Member]:
    return [cast(Member, _Member(_State(RequestId(1)), request(range(tokens), 4)))]


def test_only_a_batch_over_the_chunk_is_chunked() -> None:
    assert needs_chunks(_members(17), 16) and not needs_chunks(_members(16), 16)
    assert not needs_chunks(_members(1000), 0)  # chunked prefill off


def test_chunks_run_back_to_back_with_nothing_decoding_and_the_last_one_answers() -> None:
    async def body() -> None:
        chunked, handle, events = _setup(chunks=3, share=0.5)
        assert await chunked.start(BatchId(7), _members()) is None and _busy(chunked)
        assert await chunked.step() is None
        assert await chunked.step() == "live" and not _busy(chunked)
        assert handle.client.calls == ["PrefillV2", "PrefillChunk", "PrefillChunk"]
        assert events == ["answered"]
    asyncio.run(body())


def test_while_a_batch_decodes_a_chunk_waits_for_its_share_of_decode_time() -> None:
    async def body() -> None:
        chunked, handle, _ = _setup(chunks=3, share=0.5)
        handle.running = object()
        await chunked.start(BatchId(7), _members())
        owed = chunked._owed
        assert owed > 0  # share 0.5: as much decode time as the chunk took
        assert await chunked.step() is None and handle.client.calls == ["PrefillV2"]  # held back
        chunked.decoded(owed / 2)
        assert await chunked.step() is None and handle.client.calls == ["PrefillV2"]
        chunked.decoded(owed)
        await chunked.step()
        assert handle.client.calls == ["PrefillV2", "PrefillChunk"]
    asyncio.run(body())


def test_share_one_chunks_every_step() -> None:
    async def body() -> None:
        chunked, handle, _ = _setup(chunks=3, share=1.0)
        handle.running = object()
        await chunked.start(BatchId(7), _members())
        await chunked.step()
        assert handle.client.calls == ["PrefillV2", "PrefillChunk"]
    asyncio.run(body())


def test_a_failed_chunk_releases_the_pages_and_hands_the_requests_back() -> None:
    async def body() -> None:
        chunked, handle, events = _setup(chunks=3, share=1.0, fail_at=1)
        await chunked.start(BatchId(7), _members())
        assert handle.state.held == {RequestId(1): 11}  # (40 prompt + 4 new tokens) / 4 per page
        assert await chunked.step() is None and not _busy(chunked)
        assert handle.state.held == {} and events == ["pages", "failed"]
    asyncio.run(body())


def test_a_batch_everybody_left_is_cleared_not_computed() -> None:
    async def body() -> None:
        chunked, handle, events = _setup(chunks=3, share=1.0)
        members = _members()
        await chunked.start(BatchId(7), members)
        cast(_Member, members[0]).state.wanted = False
        assert await chunked.step() is None and not _busy(chunked)
        assert handle.client.calls == ["PrefillV2", "ClearCache"] and events == ["pages"]
    asyncio.run(body())
