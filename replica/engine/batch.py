"""Batches and their requests: pure bookkeeping (no torch, no grpc).

A request owns the pages reserved for `prompt + max_new_tokens` tokens at admission, so it never
grows its page list while decoding. `tokens` is prompt + generated; `num_cached` counts the tokens
whose K/V are in the pages, so the next forward feeds `tokens[num_cached:]` (the whole prompt on a
prefill, one token on a decode step, or more after tokens were appended from elsewhere).

Finished requests keep their pages until the caller filters them out; decode steps skip them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replica.engine.detokenizer import DetokState
from replica.engine.stopping import StopChecker
from replica.engine.types import (
    BatchId,
    CachedBatchInfo,
    FinishReason,
    RequestId,
    RequestSpec,
)
from replica.errors import AlreadyExists, InvalidArgument, NotFound
from replica.kv.block_manager import PageId

if TYPE_CHECKING:  # xgrammar and torch stay out of this module
    from replica.engine.grammar import GrammarState


@dataclass
class RequestState:
    """One request inside a cached batch."""

    spec: RequestSpec
    tokens: list[int]
    prompt_len: int
    pages: list[PageId]
    stop: StopChecker
    detok: DetokState
    num_cached: int = 0
    finish: FinishReason | None = None
    grammar: GrammarState | None = None  # structured output: advanced by every accepted token
    cached_tokens: int = 0  # prompt tokens whose K/V a prefill took from the prefix cache
    page_hashes: list[int] = field(default_factory=list)  # PageHash of pages[0..], as far as registered
    shared_upto: int = 0  # a prefill only: prompt tokens later requests of its batch share (computed first)

    @property
    def id(self) -> RequestId:
        """The request id."""
        return self.spec.id

    @property
    def num_generated(self) -> int:
        """Tokens generated so far (or appended as if generated)."""
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        """Whether generation stopped."""
        return self.finish is not None

    @property
    def pending(self) -> list[int]:
        """Tokens the next forward must feed (their K/V are not cached yet)."""
        return self.tokens[self.num_cached :]

    def capacity(self, block_size: int) -> int:
        """Tokens the reserved pages hold."""
        return len(self.pages) * block_size


@dataclass
class Batch:
    """A cached batch: an ordered list of requests under one id."""

    id: BatchId
    requests: list[RequestState] = field(default_factory=list)
    prefilling: bool = False  # prompts computed in chunks, not all yet: no decode, no migration

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def request_ids(self) -> tuple[RequestId, ...]:
        """Ids in batch order."""
        return tuple([r.spec.id for r in self.requests])

    def active(self) -> list[RequestState]:
        """Requests still generating."""
        return [r for r in self.requests if not r.finished]

    @property
    def all_finished(self) -> bool:
        """Whether no request is still generating."""
        return all(r.finished for r in self.requests)

    def pages(self) -> list[PageId]:
        """Every page the batch owns."""
        return [p for r in self.requests for p in r.pages]

    def info(self, block_size: int) -> CachedBatchInfo:
        """The caller's view of the batch."""
        max_tokens = sum([r.capacity(block_size) for r in self.requests])
        return CachedBatchInfo(id=self.id, request_ids=self.request_ids, max_tokens=max_tokens)

    def split(self, keep: Sequence[RequestId]) -> tuple[list[RequestState], list[RequestState]]:
        """(kept, dropped) for a filter keeping `keep`; refuses ids not in the batch (changes nothing)."""
        present = set(self.request_ids)
        missing = [i for i in keep if i not in present]
        if missing:
            raise InvalidArgument(f"requests {missing} are not in batch {self.id}")
        wanted = set(keep)
        kept = [r for r in self.requests if r.id in wanted]
        dropped = [r for r in self.requests if r.id not in wanted]
        return kept, dropped


class BatchStore:
    """The cached batches by id (owned by the engine thread)."""

    def __init__(self) -> None:
        self._batches: dict[BatchId, Batch] = {}

    def __len__(self) -> int:
        return len(self._batches)

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._batches

    def __iter__(self) -> Iterator[Batch]:
        return iter(list(self._batches.values()))

    def get(self, batch_id: BatchId) -> Batch:
        """The batch, or NotFound."""
        batch = self._batches.get(batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id} is not cached")
        return batch

    def get_many(self, batch_ids: Sequence[BatchId]) -> list[Batch]:
        """Several distinct batches, or NotFound / InvalidArgument (listed twice)."""
        if len(set(batch_ids)) != len(batch_ids):
            raise InvalidArgument(f"batch ids listed twice: {list(batch_ids)}")
        return [self.get(b) for b in batch_ids]

    def check_new(self, batch_id: BatchId, request_ids: Iterable[RequestId]) -> None:
        """Refuse a batch id already cached or request ids already in a cached batch."""
        if batch_id in self._batches:
            raise AlreadyExists(f"batch {batch_id} is already cached")
        taken = {r.id for b in self._batches.values() for r in b}
        clash = sorted(set(request_ids) & taken)
        if clash:
            raise InvalidArgument(f"request ids {clash} are already in a cached batch")

    def put(self, batch: Batch) -> None:
        """Cache a batch under its id."""
        if batch.id in self._batches:
            raise AlreadyExists(f"batch {batch.id} is already cached")
        self._batches[batch.id] = batch

    def pop(self, batch_id: BatchId) -> Batch:
        """Remove and return a batch, or NotFound."""
        batch = self.get(batch_id)
        del self._batches[batch_id]
        return batch


def merge(batches: Sequence[Batch]) -> Batch:
    """One batch holding every request of `batches` in order, under the first one's id."""
    if not batches:
        raise InvalidArgument("no batch to merge")
    requests = [r for b in batches for r in b.requests]
    ids = {r.spec.id for r in requests}
    if len(ids) < len(requests):  # someone is listed twice: name the first repeat
        seen: set[RequestId] = set()
        for r in requests:
            if r.id in seen:
                raise InvalidArgument(f"request {r.id} is in two of the merged batches")
            seen.add(r.id)
    return Batch(id=batches[0].id, requests=requests)
