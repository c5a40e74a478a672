"""Sampling processors against transformers' LogitsProcessor classes on hand-built logits."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from replica.engine.sampling import (
    RowInput,
    choose_next,
    frequency_presence_penalty,
    repetition_penalty,
    step_seed,
    top_k_filter,
    top_p_filter,
    typical_filter,
    warp,
)
from replica.engine.types import SamplingParams

VOCAB = 50


@pytest.fixture
def scores() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(1, VOCAB, generator=gen) * 3


def test_repetition_penalty_matches_transformers(scores: torch.Tensor) -> None:
    seen = torch.tensor([[1, 4, 4, 7, 30]])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(seen, scores.clone())
    assert torch.equal(repetition_penalty(scores, seen, 1.3), expected)


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_matches_transformers(scores: torch.Tensor, k: int) -> None:
    expected = TopKLogitsWarper(k)(torch.zeros(1, 1, dtype=torch.long), scores.clone())
    assert torch.equal(top_k_filter(scores, k), expected)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 1.0])
def test_top_p_matches_transformers(scores: torch.Tensor, p: float) -> None:
    expected = TopPLogitsWarper(p)(torch.zeros(1, 1, dtype=torch.long), scores.clone())
    assert torch.equal(top_p_filter(scores, p), expected)


@pytest.mark.parametrize("mass", [0.2, 0.7, 0.95])
def test_typical_matches_transformers(scores: torch.Tensor, mass: float) -> None:
    expected = TypicalLogitsWarper(mass)(torch.zeros(1, 1, dtype=torch.long), scores.clone())
    assert torch.equal(typical_filter(scores, mass), expected)


def test_warp_chain_matches_transformers(scores: torch.Tensor) -> None:
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, typical_p=0.9)
    ids = torch.zeros(1, 1, dtype=torch.long)
    expected = scores.clone()
    chain: list[LogitsProcessor] = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)]
    chain.append(TypicalLogitsWarper(0.9))
    for proc in chain:
        expected = proc(ids, expected)
    assert torch.allclose(warp(scores, params), expected)


def test_frequency_presence_penalty_openai_definition() -> None:
    row = torch.zeros(6)
    out = frequency_presence_penalty(row, torch.tensor([2, 2, 5]), frequency=0.5, presence=1.0)
    assert out.tolist() == [0.0, 0.0, -2.0, 0.0, 0.0, -1.5]


def test_greedy_is_argmax_and_logprob_is_log_softmax(scores: torch.Tensor) -> None:
    rows = [RowInput(SamplingParams(), tokens=[1, 2], prompt_len=2, top_n=3)]
    (choice,) = choose_next(scores, rows)
    logprobs = torch.log_softmax(scores[0], -1)
    assert choice.token_id == int(scores[0].argmax())
    assert math.isclose(choice.logprob, float(logprobs.max()), rel_tol=1e-6)
    assert choice.top_ids[0] == choice.token_id and len(choice.top_ids) == 3
    assert list(choice.top_logprobs) == sorted(choice.top_logprobs, reverse=True)


@pytest.mark.parametrize("top_n", [0, 2])
def test_greedy_ties_pick_the_first_maximum_like_argmax(top_n: int) -> None:
    # both the plain path (no row asks for alternatives) and the per-row one
    nan = float("nan")
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0], [-1.0, nan, 5.0, nan]])
    rows = [RowInput(SamplingParams(), tokens=[1], prompt_len=1, top_n=top_n)] * 3
    choices = choose_next(logits, rows)
    assert [c.token_id for c in choices] == torch.argmax(logits, -1).tolist() == [1, 0, 1]
    assert [len(c.top_ids) for c in choices] == [top_n] * 3
    assert choices[0].logprob == float(torch.log_softmax(logits[0], -1)[1])


def test_greedy_applies_penalties(scores: torch.Tensor) -> None:
    best = int(scores[0].argmax())
    params = SamplingParams(presence_penalty=1000.0)
    (choice,) = choose_next(scores, [RowInput(params, tokens=[0, best], prompt_len=1)])
    assert choice.token_id != best


def test_logit_bias_is_added_before_choosing_and_leaves_other_rows_alone(scores: torch.Tensor) -> None:
    order = scores[0].argsort(descending=True).tolist()
    banned = SamplingParams(logit_bias=((order[0], -100.0),))
    forced = SamplingParams(logit_bias=((order[-1], 100.0),))
    nudged = SamplingParams(logit_bias=((order[1], 0.25), (order[2], -0.5)))
    batch = scores.repeat(4, 1)
    rows = [RowInput(p, tokens=[0], prompt_len=1) for p in (banned, forced, SamplingParams(), nudged)]
    ban, force, plain, nudge = choose_next(batch, rows)
    assert ban.token_id == order[1] and force.token_id == order[-1] and plain.token_id == order[0]
    expected = scores[0].clone()
    expected[order[1]] += 0.25
    expected[order[2]] -= 0.5
    assert nudge.token_id == int(expected.argmax())
    assert nudge.logprob == pytest.approx(float(torch.log_softmax(expected, -1)[nudge.token_id]), abs=1e-6)
    # bias, then penalties: a banned token stays banned whatever the presence penalty does elsewhere
    both = SamplingParams(logit_bias=((order[0], -100.0),), presence_penalty=1000.0)
    (choice,) = choose_next(scores, [RowInput(both, tokens=[0, order[1]], prompt_len=1)])
    assert choice.token_id == order[2]


def test_seeded_sampling_depends_only_on_seed_and_step(scores: torch.Tensor) -> None:
    params = SamplingParams(do_sample=True, seed=42, temperature=1.5)
    row = RowInput(params, tokens=[1, 2, 3], prompt_len=2)
    other = RowInput(SamplingParams(do_sample=True, seed=7), tokens=[9], prompt_len=1)
    alone = choose_next(scores, [row])[0]
    batch = torch.cat([scores.roll(3, -1), scores])
    together = choose_next(batch, [other, row])[1]
    assert alone == together
    draws = {choose_next(scores, [RowInput(params, [1] * n, 1)])[0].token_id for n in range(1, 30)}
    assert len(draws) > 1  # different steps draw differently


def test_step_seed_mixes() -> None:
    assert step_seed(1, 0) != step_seed(0, 1)
    assert 0 <= step_seed(2**64 - 1, 10**6) < 2**64


def test_top_k_one_sampling_is_greedy(scores: torch.Tensor) -> None:
    params = SamplingParams(do_sample=True, top_k=1, seed=5)
    (choice,) = choose_next(scores, [RowInput(params, [1], 1)])
    assert choice.token_id == int(scores[0].argmax())
    assert choice.logprob == 0.0
