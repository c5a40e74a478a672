"""Chunked prefill in a colocated loop: a batch over `--max-batch-prefill-tokens` is prefilled a
chunk per loop step, with a decode step of the running batch between chunks.

```
 step k:    PrefillV2(batch, chunk_tokens=C) ─► prefilling (no tokens)      DecodeV2(running)
 step k+1:  PrefillChunk(batch, C)           ─► prefilling                  DecodeV2(running)
 step k+n:  PrefillChunk(batch, C)           ─► first tokens, batch cached ─► joins the running batch
```
A chunk costs one forward of at most C tokens, so a long prompt holds a decode step up by one chunk
instead of its whole prefill. While a batch decodes, chunks are paced to take at most `share` of the
replica's time (`--prefill-chunk-share`): after a chunk of t seconds the next waits until the decode
steps since took t × (1 - share) / share, so the running requests' TPOT grows by at most
1 / (1 - share) (2× at the default 0.5) however long the prompt; with nothing decoding, chunks run
back to back. One chunked batch at a time per replica: the loop takes nothing
else off the queue until it is done. A replica that ignores `chunk_tokens` (it predates it)
answers the first call with the first tokens, and the batch is done at once. A batch whose every
request went away meanwhile is cleared instead of computed on; a failed chunk releases the batch's
pages and re-runs or fails its requests like any failed prefill.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.batches import LiveBatch, Member, member_blocks, spec_for
from router.errors import ReplicaCallError
from router.registry import ReplicaHandle
from router.types import BatchId, RequestId, StepResult

Answered = Callable[[list[Member], dict[RequestId, int], StepResult, float], Awaitable[LiveBatch | None]]
"""The loop's handling of a prefill's first tokens (`ReplicaWorker.prefill_answered`)."""
Failed = Callable[[ReplicaCallError, list[Member]], None]
"""The cluster's handling of a failed call's requests (`Cluster.on_error`)."""


def needs_chunks(members: list[Member], chunk_tokens: int) -> bool:
    """Whether a batch of `members` is prefilled in chunks of `chunk_tokens` (0: never)."""
    return chunk_tokens > 0 and sum(len(m.request.input_ids) for m in members) > chunk_tokens


@dataclass
class _Prefilling:
    """The batch being prefilled, and what the router holds for it."""

    batch_id: BatchId
    members: list[Member]
    pages: dict[RequestId, int]
    start: float


class ChunkedPrefill:
    """At most one batch being prefilled in chunks on one replica."""

    def __init__(self, handle: ReplicaHandle, chunk_tokens: int, answered: Answered, failed: Failed,
                 on_pages: Callable[[], None], share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.h = handle
        self.clock = clock
        self.chunk_tokens = chunk_tokens
        self.share = share
        self._owed = 0.0  # seconds of decode steps due before the next chunk
        self._answered = answered
        self._failed = failed
        self._on_pages = on_pages
        self._current: _Prefilling | None = None

    @property
    def busy(self) -> bool:
        """A batch is being prefilled in chunks."""
        return self._current is not None

    async def start(self, batch_id: BatchId, members: list[Member]) -> LiveBatch | None:
        """Hold the batch's pages and prefill its first chunk; the cached batch if that was all."""
        pages = {m.id: member_blocks(m, self.h.block_size) for m in members}
        self.h.state.hold(pages)
        for m in members:
            m.state.prefilling(self.h.id, True)
        self._current = _Prefilling(batch_id, members, pages, self.clock())
        spec = spec_for(batch_id, members, self.h.block_size)
        return await self._call(lambda: self.h.client.prefill(spec, chunk_tokens=self.chunk_tokens))

    def decoded(self, seconds: float) -> None:
        """A decode step of the running batch took `seconds` (it pays off the chunks' time)."""
        self._owed = max(self._owed - seconds, 0.0)

    async def step(self) -> LiveBatch | None:
        """The next chunk, when its share of time allows; the cached batch once its prompts are
        computed (None until then)."""
        current = self._current
        if current is None or (self._owed > 0 and self.h.running is not None):
            return None
        if not any(m.wanted for m in current.members):  # everybody left: stop computing for nobody
            self._drop(current)
            with contextlib.suppress(ReplicaCallError):
                await self.h.client.clear_cache(current.batch_id)
            return None
        return await self._call(lambda: self.h.client.prefill_chunk(current.batch_id, self.chunk_tokens))

    async def _call(self, call: Callable[[], Awaitable[StepResult]]) -> LiveBatch | None:
        current = self._current
        assert current is not None
        began = self.clock()
        try:
            result = await call()
        except ReplicaCallError as exc:
            self._drop(current)
            self._failed(exc, current.members)
            return None
        if self.share < 1.0:
            self._owed = (self.clock() - began) * (1.0 - self.share) / self.share
        if not result.generations and result.batch is not None:
            return None  # more chunks to go
        self._current = None
        return await self._answered(current.members, current.pages, result, self.clock() - current.start)

    def _drop(self, current: _Prefilling) -> None:
        """Forget the batch and release what the router held for it."""
        self._current = None
        self.h.state.release(current.pages)
        self._on_pages()
