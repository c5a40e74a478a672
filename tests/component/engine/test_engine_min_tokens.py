"""min_new_tokens on the engine (issue 26 part 4): EOS masked out and stop sequences not looked for
until the request has that many tokens, on the CPU path and the batched path; a continuation is
sent what is left; more than max_new_tokens is refused with the pages untouched."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from replica.config import ReplicaConfig
from replica.engine.banned import without_banned
from replica.engine.device_sampling import choose_batched
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.sampling import choose_next
from replica.engine.types import (
    BatchId,
    BatchSpec,
    DecodeInput,
    FinishReason,
    RequestId,
    RequestSpec,
    RowInput,
    SamplingParams,
    StoppingParams,
)
from replica.errors import InvalidArgument

PROMPT = (5, 17, 33, 2, 48, 9, 60)
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def engine(tiny_model_factory: Callable[..., Path]) -> Engine:
    return build_engine(
        ReplicaConfig(model=tiny_model_factory(arch="llama"), port=0, num_blocks=64, block_size=8)
    )


def _run(engine: Engine, batch_id: int, spec: RequestSpec) -> tuple[list[int], str, FinishReason]:
    """One request to its end: its tokens, its text and why it stopped."""
    ids: list[int] = []
    result = engine.prefill(BatchSpec(BatchId(batch_id), (spec,)))
    while True:
        (gen,) = result.generations
        ids += gen.tokens.ids
        if result.batch is None:
            assert gen.generated_text is not None
            return ids, gen.generated_text.text, gen.generated_text.finish_reason
        result = engine.decode([DecodeInput(result.batch.id)])


def _spec(
    stopping: StoppingParams,
    sampling: SamplingParams = GREEDY,
    prompt: tuple[int, ...] = PROMPT,
    prefix: int = 0,
) -> RequestSpec:
    return RequestSpec(RequestId(1), prompt, sampling=sampling, stopping=stopping, generated_prefix=prefix)


def test_eos_is_held_back_until_min_new_tokens(engine: Engine) -> None:
    eos = min(engine.eos_token_ids)
    plain, _, _ = _run(engine, 1, _spec(StoppingParams(max_new_tokens=4, ignore_eos=True)))
    assert eos not in plain  # the precondition of the comparison below
    eager = SamplingParams(logit_bias=((eos, 100.0),))  # EOS is the greedy choice at every step
    ids, _, why = _run(engine, 2, _spec(StoppingParams(max_new_tokens=8), eager))
    assert (ids, why) == ([eos], FinishReason.EOS_TOKEN)
    ids, _, why = _run(engine, 3, _spec(StoppingParams(max_new_tokens=8, min_new_tokens=4), eager))
    # EOS masked out: the first 4 are the unbiased greedy tokens, then EOS comes at once
    assert (ids, why) == ([*plain, eos], FinishReason.EOS_TOKEN)
    sampled = SamplingParams(do_sample=True, seed=5, logit_bias=((eos, 100.0),))
    ids, _, why = _run(engine, 4, _spec(StoppingParams(max_new_tokens=8, min_new_tokens=3), sampled))
    assert len(ids) == 4 and eos not in ids[:3] and (ids[3], why) == (eos, FinishReason.EOS_TOKEN)
    # a continuation after 2 tokens is sent the 2 left: the same tokens as the uninterrupted run
    rest, _, why = _run(
        engine,
        5,
        _spec(StoppingParams(max_new_tokens=6, min_new_tokens=2), eager, PROMPT + tuple(plain[:2]), prefix=2),
    )
    assert (rest, why) == ([*plain[2:], eos], FinishReason.EOS_TOKEN)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_stop_sequences_wait_for_min_new_tokens(engine: Engine) -> None:
    _, text, _ = _run(engine, 10, _spec(StoppingParams(max_new_tokens=6, ignore_eos=True)))
    stop = text.strip()[:1]  # the first character the output shows
    stopping = StoppingParams(max_new_tokens=6, stop_sequences=(stop,), ignore_eos=True)
    early, _, why = _run(engine, 11, _spec(stopping))
    assert len(early) < 4 and why is FinishReason.STOP_SEQUENCE  # the precondition
    late, _, _ = _run(engine, 12, _spec(dataclasses.replace(stopping, min_new_tokens=4)))
    assert len(late) >= 4 and late[: len(early)] == early
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_min_over_max_is_refused_and_changes_nothing(engine: Engine) -> None:
    free = engine.blocks.num_free
    with pytest.raises(InvalidArgument, match="min_new_tokens"):
        engine.prefill(BatchSpec(BatchId(20), (_spec(StoppingParams(max_new_tokens=3, min_new_tokens=4)),)))
    assert engine.blocks.num_free == free


def test_a_ban_that_would_leave_no_token_is_not_applied() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [float("-inf"), 5.0, float("-inf")]])
    rows = [
        RowInput(SamplingParams(), (0,), 1, banned=(2,)),
        RowInput(SamplingParams(), (0,), 1, banned=(1,)),
    ]
    out = without_banned(logits, rows)
    assert out[0].tolist() == [0.0, 1.0, float("-inf")] and out[1].tolist() == logits[1].tolist()
    assert without_banned(logits, [RowInput(SamplingParams(), (0,), 1)] * 2) is logits


def test_both_sampling_paths_honour_the_ban() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0]] * 2)
    rows = [
        RowInput(SamplingParams(), (0,), 1, banned=(2,)),
        RowInput(SamplingParams(do_sample=True, seed=1, temperature=0.01), (0,), 1, banned=(2,)),
    ]
    assert [c.token_id for c in choose_next(logits, rows)] == [3, 3]
    assert [c.token_id for c in choose_batched(logits, rows)] == [3, 3]
