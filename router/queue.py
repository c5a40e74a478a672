"""The router's request queue and batcher: FIFO under prefill-token, total-token and free-block budgets.

Pure Python (no grpc, no asyncio, no torch) so it is unit-tested in milliseconds. The scheduler
pushes one `QueueEntry` per request (or per continuation of a request that has to be re-run
elsewhere), and each prefill-capable replica loop asks for the next batch that fits its budgets.

A request reserves pages for `prompt + max_new_tokens` tokens on the replica (the replica's own
admission rule), so the batcher counts exactly the pages the replica will allocate.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from router.types import BatchId, GenerateRequest, RequestId


def blocks_for(tokens: int, block_size: int) -> int:
    """Pages needed to hold `tokens` tokens (ceil division)."""
    return -(-tokens // block_size)


def request_blocks(request: GenerateRequest, block_size: int) -> int:
    """Pages the replica reserves for one request: prompt plus every token it may generate."""
    return blocks_for(len(request.input_ids) + request.stopping.max_new_tokens, block_size)


@dataclass(frozen=True)
class QueueEntry:
    """One queued run of a request. `is_alive` turns False when the client went away."""

    request_id: RequestId
    request: GenerateRequest
    is_alive: Callable[[], bool]


@dataclass(frozen=True)
class Budgets:
    """What one prefill batch may hold, from the router config and the replica's free pages."""

    max_prefill_tokens: int
    max_total_tokens: int
    free_blocks: int
    block_size: int
    max_batch_size: int = 256

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_batch_size < 1:
            raise ValueError("block_size and max_batch_size must be >= 1")


@dataclass(frozen=True)
class PlannedBatch:
    """A batch taken off the queue: its id, its entries in FIFO order and the pages it reserves."""

    id: BatchId
    entries: tuple[QueueEntry, ...]
    blocks: int
    block_size: int

    @property
    def max_tokens(self) -> int:
        """Tokens the batch's pages hold (the `Batch.max_tokens` sent to the replica)."""
        return self.blocks * self.block_size

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the whole batch."""
        return sum(len(e.request.input_ids) for e in self.entries)


class BatchIds:
    """Monotonically increasing batch ids, shared by every batch the router creates."""

    def __init__(self, start: int = 1) -> None:
        self._counter = itertools.count(start)

    def next(self) -> BatchId:
        """The next unused id."""
        return BatchId(next(self._counter))


class RequestQueue:
    """FIFO of queued requests; `next_batch` pops the longest prefix that fits the budgets."""

    def __init__(self, batch_ids: BatchIds | None = None) -> None:
        self._entries: deque[QueueEntry] = deque()
        self._prompt_tokens = 0  # of the queued entries, kept as they come and go
        self.batch_ids = batch_ids or BatchIds()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[QueueEntry]:
        return iter(self._entries)

    def push(self, entry: QueueEntry) -> None:
        """Queue a new request at the back."""
        self._entries.append(entry)
        self._prompt_tokens += len(entry.request.input_ids)

    def push_front(self, entry: QueueEntry) -> None:
        """Queue a request that must run again (its replica died) ahead of new ones."""
        self._entries.appendleft(entry)
        self._prompt_tokens += len(entry.request.input_ids)

    def take_all(self) -> list[QueueEntry]:
        """Empty the queue; returns what was in it, in order."""
        entries, self._entries = list(self._entries), deque()
        self._prompt_tokens = 0
        return entries

    def drop_dead(self) -> int:
        """Remove entries whose client went away; returns how many were dropped."""
        alive = [e for e in self._entries if e.is_alive()]
        dropped = len(self._entries) - len(alive)
        self._entries = deque(alive)
        self._prompt_tokens = sum(len(e.request.input_ids) for e in alive)
        return dropped

    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens waiting for a prefill (a load signal for metrics)."""
        return self._prompt_tokens

    def next_batch(self, budgets: Budgets, accept: Callable[[QueueEntry], bool] | None = None
                   ) -> PlannedBatch | None:
        """Pop the FIFO prefix that fits every budget, or None when nothing fits (or nothing waits).

        The head request is taken even when it alone exceeds the prefill-token budget (it was
        admitted against the replica's own limits), but never when its pages do not fit: FIFO
        order is kept, so a large head waits for pages rather than being overtaken.

        `accept` (the routing rule): entries it refuses are passed over and stay queued in place,
        for another replica; the FIFO order above holds among the entries it accepts.
        """
        self.drop_dead()
        taken: list[QueueEntry] = []
        left: list[QueueEntry] = []
        prefill = blocks = 0
        while self._entries and len(taken) < budgets.max_batch_size:
            entry = self._entries[0]
            if accept is not None and not accept(entry):
                left.append(self._entries.popleft())
                continue
            need = request_blocks(entry.request, budgets.block_size)
            prompt = len(entry.request.input_ids)
            if not self._fits(budgets, taken, prefill + prompt, blocks + need):
                break
            taken.append(self._entries.popleft())
            self._prompt_tokens -= prompt
            prefill += prompt
            blocks += need
        self._entries.extendleft(reversed(left))
        if not taken:
            return None
        return PlannedBatch(self.batch_ids.next(), tuple(taken), blocks, budgets.block_size)

    @staticmethod
    def _fits(budgets: Budgets, taken: list[QueueEntry], prefill: int, blocks: int) -> bool:
        if blocks > budgets.free_blocks:
            return False
        if blocks * budgets.block_size > budgets.max_total_tokens and taken:
            return False
        return not (prefill > budgets.max_prefill_tokens and taken)
