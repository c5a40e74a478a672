"""The request queue and batcher: FIFO under prefill-token, total-token and free-block budgets."""

from __future__ import annotations

import pytest

from router.queue import Budgets, QueueEntry, RequestQueue, blocks_for, request_blocks
from router.types import GenerateRequest, RequestId, SamplingParams, StoppingParams


def entry(rid: int, prompt: int, new: int, alive: bool = True) -> QueueEntry:
    req = GenerateRequest(tuple(range(1, prompt + 1)), SamplingParams(), StoppingParams(new))
    return QueueEntry(RequestId(rid), req, lambda: alive)


def budgets(prefill: int = 1000, total: int = 10_000, free: int = 1000, bs: int = 16, size: int = 64
            ) -> Budgets:
    return Budgets(prefill, total, free, bs, size)


def ids(batch: object) -> list[int]:
    return [e.request_id for e in batch.entries]  # type: ignore[attr-defined]


def test_pages_cover_prompt_and_every_new_token() -> None:
    assert blocks_for(16, 16) == 1 and blocks_for(17, 16) == 2 and blocks_for(1, 16) == 1
    assert request_blocks(entry(1, 10, 7).request, 16) == 2


def test_fifo_prefix_under_prefill_token_budget() -> None:
    q = RequestQueue()
    for i in range(4):
        q.push(entry(i, 30, 2))
    batch = q.next_batch(budgets(prefill=70))
    assert batch is not None and ids(batch) == [0, 1]
    assert batch.prompt_tokens == 60 and len(q) == 2


def test_block_budget_stops_the_batch_and_keeps_fifo_order() -> None:
    q = RequestQueue()
    q.push(entry(0, 10, 6))   # 1 page
    q.push(entry(1, 40, 8))   # 3 pages
    q.push(entry(2, 5, 5))    # 1 page: would fit, but must not overtake request 1
    batch = q.next_batch(budgets(free=2))
    assert batch is not None and ids(batch) == [0]
    assert batch.blocks == 1 and batch.max_tokens == 16
    assert q.next_batch(budgets(free=2)) is None
    assert len(q) == 2


def test_total_token_budget_counts_whole_pages() -> None:
    q = RequestQueue()
    for i in range(3):
        q.push(entry(i, 10, 10))  # 2 pages = 32 tokens each
    batch = q.next_batch(budgets(total=64))
    assert batch is not None and ids(batch) == [0, 1]


def test_head_over_prefill_budget_still_runs_alone() -> None:
    q = RequestQueue()
    q.push(entry(0, 100, 1))
    q.push(entry(1, 1, 1))
    batch = q.next_batch(budgets(prefill=50))
    assert batch is not None and ids(batch) == [0]


def test_max_batch_size() -> None:
    q = RequestQueue()
    for i in range(5):
        q.push(entry(i, 1, 1))
    batch = q.next_batch(budgets(size=3))
    assert batch is not None and ids(batch) == [0, 1, 2]


def test_requests_whose_client_went_away_are_dropped() -> None:
    q = RequestQueue()
    q.push(entry(0, 5, 1, alive=False))
    q.push(entry(1, 5, 1))
    q.push(entry(2, 5, 1, alive=False))
    batch = q.next_batch(budgets())
    assert batch is not None and ids(batch) == [1]
    assert len(q) == 0


def test_batch_ids_increase_and_requeued_entries_go_first() -> None:
    q = RequestQueue()
    q.push(entry(0, 5, 1))
    first = q.next_batch(budgets())
    q.push(entry(1, 5, 1))
    q.push_front(entry(2, 5, 1))
    second = q.next_batch(budgets(size=1))
    assert first is not None and second is not None
    assert second.id > first.id and ids(second) == [2]
    assert q.waiting_prompt_tokens() == 5


def test_empty_queue_and_bad_budgets() -> None:
    assert RequestQueue().next_batch(budgets()) is None
    with pytest.raises(ValueError):
        Budgets(1, 1, 1, 0)
