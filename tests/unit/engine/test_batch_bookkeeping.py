"""Batch bookkeeping: merge, filter split, the store's refusals, validation of new batches."""

from __future__ import annotations

import math

import pytest

from replica.engine.batch import Batch, BatchStore, RequestState, merge
from replica.engine.detokenizer import DetokState
from replica.engine.stopping import StopChecker
from replica.engine.types import (
    BatchId,
    BatchSpec,
    FinishReason,
    RequestId,
    RequestSpec,
    SamplingParams,
    StoppingParams,
)
from replica.engine.validation import Limits, admit_batch, check_appended
from replica.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from replica.kv.block_manager import PageId

LIMITS = Limits(vocab_size=100, max_input_tokens=8, max_total_tokens=12, max_prefill_tokens=16)


def _request(rid: int, prompt: int = 3, pages: int = 1) -> RequestState:
    spec = RequestSpec(RequestId(rid), input_tokens=tuple(range(1, prompt + 1)))
    return RequestState(
        spec=spec,
        tokens=list(spec.input_tokens),
        prompt_len=prompt,
        pages=[PageId(rid * 10 + i) for i in range(pages)],
        stop=StopChecker(spec.stopping, ()),
        detok=DetokState.after_prompt(prompt),
    )


def test_merge_keeps_order_and_first_id() -> None:
    a = Batch(BatchId(1), [_request(1), _request(2)])
    b = Batch(BatchId(2), [_request(3, pages=2)])
    merged = merge([a, b])
    assert merged.id == 1 and merged.request_ids == (1, 2, 3)
    assert merged.info(block_size=4).max_tokens == 4 * 4
    with pytest.raises(InvalidArgument):
        merge([a, Batch(BatchId(3), [_request(2)])])
    with pytest.raises(InvalidArgument):
        merge([])


def test_split_and_active() -> None:
    batch = Batch(BatchId(1), [_request(1), _request(2), _request(3)])
    batch.requests[1].finish = FinishReason.LENGTH
    assert [r.id for r in batch.active()] == [1, 3] and not batch.all_finished
    kept, dropped = batch.split([RequestId(3), RequestId(1)])
    assert [r.id for r in kept] == [1, 3] and [r.id for r in dropped] == [2]
    with pytest.raises(InvalidArgument):
        batch.split([RequestId(9)])


def test_pending_tokens_follow_num_cached() -> None:
    request = _request(1, prompt=4)
    assert request.pending == [1, 2, 3, 4]
    request.num_cached = 4
    request.tokens.append(50)
    assert request.pending == [50] and request.num_generated == 1


def test_store_refusals() -> None:
    store = BatchStore()
    store.put(Batch(BatchId(1), [_request(1)]))
    with pytest.raises(AlreadyExists):
        store.check_new(BatchId(1), [])
    with pytest.raises(InvalidArgument):
        store.check_new(BatchId(2), [RequestId(1)])
    with pytest.raises(NotFound):
        store.get(BatchId(7))
    with pytest.raises(InvalidArgument):
        store.get_many([BatchId(1), BatchId(1)])
    assert store.pop(BatchId(1)).id == 1 and len(store) == 0


def _spec(*requests: RequestSpec) -> BatchSpec:
    return BatchSpec(BatchId(1), tuple(requests))


def _req(rid: int = 1, tokens: tuple[int, ...] = (1, 2), **kwargs: object) -> RequestSpec:
    kwargs.setdefault("stopping", StoppingParams(max_new_tokens=2))
    return RequestSpec(RequestId(rid), input_tokens=tokens, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        (_spec(), InvalidArgument),
        (_spec(_req(1), _req(1)), InvalidArgument),
        (_spec(_req(tokens=())), InvalidArgument),
        (_spec(_req(tokens=(1, 100))), InvalidArgument),
        (_spec(_req(sampling=SamplingParams(temperature=math.nan))), InvalidArgument),
        (_spec(_req(sampling=SamplingParams(temperature=-1.0))), InvalidArgument),
        (_spec(_req(sampling=SamplingParams(top_p=1.5))), InvalidArgument),
        (_spec(_req(sampling=SamplingParams(top_p=-0.1))), InvalidArgument),
        (_spec(_req(sampling=SamplingParams(watermark=True))), InvalidArgument),
        (_spec(_req(stopping=StoppingParams(max_new_tokens=0))), InvalidArgument),
        (_spec(_req(inputs="text only", tokens=())), InvalidArgument),  # no tokenizer given
        (_spec(_req(tokens=tuple(range(1, 10)))), ResourceExhausted),  # 9 > max_input 8
        (_spec(_req(stopping=StoppingParams(max_new_tokens=11))), ResourceExhausted),  # 2 + 11 > 12
        (_spec(*[_req(i, tokens=(1,) * 8) for i in range(3)]), ResourceExhausted),  # 24 > prefill 16
    ],
)
def test_admission_refusals(spec: BatchSpec, error: type[Exception]) -> None:
    with pytest.raises(error):
        admit_batch(spec, LIMITS, tokenize=None)


def test_truncate_keeps_the_last_tokens_and_text_is_tokenized() -> None:
    prompts = admit_batch(_spec(_req(tokens=tuple(range(1, 12)), truncate=4)), LIMITS, None)
    assert prompts == [[8, 9, 10, 11]]
    assert admit_batch(_spec(_req(inputs="ab", tokens=())), LIMITS, lambda s: [5, 6]) == [[5, 6]]


def test_appended_tokens_checked() -> None:
    check_appended([1, 2], 2, 100, "b")
    with pytest.raises(InvalidArgument):
        check_appended([1], 2, 100, "b")
    with pytest.raises(InvalidArgument):
        check_appended([1, 200], 2, 100, "b")
