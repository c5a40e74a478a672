"""The batched sampler (the device path of choose_next) against the per-row CPU reference, on CPU tensors."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from replica.engine import seeding
from replica.engine.batched_processors import race_bits, race_noise
from replica.engine.device_sampling import (
    choose_batched,
    choose_tensors,
    pack_choices,
    plan_step,
    to_host,
    unpack_choices,
)
from replica.engine.sampling import choose_next
from replica.engine.types import Choice, RowInput, SamplingParams

VOCAB = 97


def _logits(batch: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _dense(choice: Choice, vocab: int) -> torch.Tensor:
    """A row's whole distribution from a Choice that asked for every alternative."""
    out = torch.full((vocab,), float("nan"), dtype=torch.float64)
    out[list(choice.top_ids)] = torch.tensor(choice.top_logprobs, dtype=torch.float64)
    return out


def _assert_same_distribution(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any() and not want.isnan().any()
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    assert torch.allclose(got[finite], want[finite], atol=1e-5, rtol=0)


def _random_params(rng: random.Random, vocab: int, sample: bool) -> SamplingParams:
    def maybe(value: float, off: float) -> float:
        return value if rng.random() < 0.5 else off

    bias = tuple((rng.randrange(vocab), rng.uniform(-5, 5)) for _ in range(rng.choice([0, 0, 1, 3])))
    return SamplingParams(
        do_sample=sample,
        temperature=rng.choice([1.0, 0.05, 0.4, 0.9, 1.7]),
        top_k=rng.choice([0, 0, 1, 5, 40, vocab, vocab + 50]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.6, 1e-6]),
        typical_p=rng.choice([1.0, 1.0, 0.9, 0.3]),
        seed=rng.randrange(2**63),
        repetition_penalty=maybe(rng.uniform(0.6, 1.8), 1.0),
        frequency_penalty=maybe(rng.uniform(-1, 1), 0.0),
        presence_penalty=maybe(rng.uniform(-1, 1), 0.0),
        logit_bias=bias,
    )


def _random_rows(rng: random.Random, batch: int, vocab: int, top_n: int | None = None) -> list[RowInput]:
    rows = []
    for _ in range(batch):
        kind = rng.choice(["plain", "greedy", "sample", "sample"])
        params = SamplingParams() if kind == "plain" else _random_params(rng, vocab, kind == "sample")
        prompt = rng.randint(1, 8)
        tokens = [rng.randrange(vocab) for _ in range(prompt + rng.randint(0, 10))]
        rows.append(RowInput(params, tokens, prompt, rng.randint(0, 4) if top_n is None else top_n))
    return rows


# ------------------------------------------------------------------------------ against the reference
@pytest.mark.parametrize("trial", range(6))
def test_greedy_rows_match_the_reference_tokens_logprobs_and_top_n(trial: int) -> None:
    rng = random.Random(trial)
    rows = []
    for _ in range(16):
        params = _random_params(rng, VOCAB, sample=False) if rng.random() < 0.6 else SamplingParams()
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        rows.append(RowInput(params, tokens, rng.randint(0, 3), rng.randint(0, 5)))
    logits = _logits(len(rows), trial)
    got, want = choose_batched(logits, rows), choose_next(logits, rows)
    assert [c.token_id for c in got] == [c.token_id for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert g.top_ids == w.top_ids
        assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-5)


@pytest.mark.parametrize("trial", range(8))
def test_every_row_of_a_mixed_batch_has_the_reference_distribution(trial: int) -> None:
    rng = random.Random(100 + trial)
    rows = _random_rows(rng, 12, VOCAB, top_n=VOCAB)
    logits = _logits(len(rows), trial)
    got, want = choose_batched(logits, rows), choose_next(logits, rows)
    for row, g, w in zip(rows, got, want, strict=True):
        _assert_same_distribution(_dense(g, VOCAB), _dense(w, VOCAB))
        if row.params.do_sample:  # drawn from the support, and its logprob is the distribution's
            assert math.isfinite(g.logprob)
            assert g.logprob == _dense(g, VOCAB)[g.token_id]
        else:
            assert g.token_id == w.token_id


def test_the_final_logprobs_tensor_is_the_reference_one() -> None:
    rows = _random_rows(random.Random(7), 10, VOCAB, top_n=VOCAB)
    logits = _logits(len(rows), 7)
    _, logprobs = choose_tensors(logits, plan_step(rows, VOCAB))
    for i, want in enumerate(choose_next(logits, rows)):
        _assert_same_distribution(logprobs[i].double(), _dense(want, VOCAB))


def test_edge_parameters() -> None:
    logits = _logits(1, 3)
    best = int(logits[0].argmax())
    tiny_p = SamplingParams(do_sample=True, top_p=1e-6, seed=1)
    cold = SamplingParams(do_sample=True, temperature=0.01, seed=2)
    wide_k = SamplingParams(do_sample=True, top_k=VOCAB + 1000, temperature=0.7, seed=3)
    narrow_typical = SamplingParams(do_sample=True, typical_p=0.01, seed=4)
    for params in (tiny_p, cold):  # everything but the most likely token is gone (or nearly)
        (choice,) = choose_batched(logits, [RowInput(params, [1], 1)])
        assert choice.token_id == best and choice.logprob == pytest.approx(0.0, abs=1e-6)
    (wide,) = choose_batched(logits, [RowInput(wide_k, [1], 1, VOCAB)])
    _assert_same_distribution(_dense(wide, VOCAB), torch.log_softmax(logits[0].double() / 0.7, -1))
    (typical,) = choose_batched(logits, [RowInput(narrow_typical, [1], 1, VOCAB)])
    (reference,) = choose_next(logits, [RowInput(narrow_typical, [1], 1, VOCAB)])
    _assert_same_distribution(_dense(typical, VOCAB), _dense(reference, VOCAB))
    assert typical.logprob == 0.0 and typical.token_id == reference.token_id  # one token left


def test_greedy_ties_pick_the_first_maximum() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    penalised = SamplingParams(repetition_penalty=2.0)  # token 2 is seen: 1 / 2, the ties stay
    rows = [RowInput(SamplingParams(), [0], 1), RowInput(penalised, [2], 1)]
    assert [c.token_id for c in choose_batched(logits, rows)] == [1, 0]


# ------------------------------------------------------------------------------ seeded draws
def test_seeded_draws_do_not_depend_on_the_batch_or_the_position() -> None:
    rng = random.Random(5)
    rows = _random_rows(rng, 10, VOCAB)
    logits = _logits(len(rows), 5)
    alone = [choose_batched(logits[i : i + 1], [row])[0] for i, row in enumerate(rows)]
    assert choose_batched(logits, rows) == alone
    others = _random_rows(rng, 7, VOCAB)
    mixed = list(range(len(rows) + len(others)))
    rng.shuffle(mixed)
    all_logits = torch.cat([logits, _logits(len(others), 6)])
    all_rows = [*rows, *others]
    shuffled = choose_batched(all_logits[mixed], [all_rows[i] for i in mixed])
    back = {index: choice for index, choice in zip(mixed, shuffled, strict=True)}
    assert [back[i] for i in range(len(rows))] == alone


def test_different_seeds_and_steps_draw_differently() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: any fixed draw would be a bug

    def draw(params: SamplingParams, step: int) -> int:
        return choose_batched(logits, [RowInput(params, range(step + 1), 1)])[0].token_id

    by_seed = {draw(SamplingParams(do_sample=True, seed=s), 0) for s in range(40)}
    by_step = {draw(SamplingParams(do_sample=True, seed=9), n) for n in range(40)}
    assert len(by_seed) > 20 and len(by_step) > 20


def _chi_square(draws: Sequence[int], probs: Sequence[float]) -> float:
    counts = Counter(draws)
    n = len(draws)
    assert set(counts) <= {i for i, p in enumerate(probs) if p > 0}
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


# the chi-square 99.99 % quantiles for 5 and 15 degrees of freedom: a correct sampler fails once in 10^4
CHI2_5, CHI2_15 = 25.7, 42.6


@pytest.mark.parametrize("by", ["seed", "step"])
def test_draws_follow_the_distribution(by: str) -> None:
    probs = [0.4, 0.25, 0.15, 0.1, 0.07, 0.03]
    n = 4000
    logits = torch.tensor([probs]).log().expand(n, -1)
    if by == "seed":
        rows = [RowInput(SamplingParams(do_sample=True, seed=s), [1], 1) for s in range(1, n + 1)]
    else:  # one request, step after step (its tokens do not matter without penalties)
        params = SamplingParams(do_sample=True, seed=1234)
        rows = [RowInput(params, range(step + 1), 1) for step in range(n)]
    draws = [c.token_id for c in choose_batched(logits, rows)]
    assert _chi_square(draws, probs) < CHI2_5
    assert _chi_square([0] * n, probs) > CHI2_5  # what "always the most likely" would score


def test_draws_follow_the_warped_distribution() -> None:
    logits = _logits(1, 11, vocab=30)
    params = [SamplingParams(do_sample=True, seed=s, temperature=0.8, top_k=6) for s in range(3000)]
    rows = [RowInput(p, [1], 1) for p in params]
    draws = [c.token_id for c in choose_batched(logits.expand(len(rows), -1), rows)]
    probs = torch.topk(logits[0] / 0.8, 6)
    expected = dict(zip(probs.indices.tolist(), probs.values.softmax(-1).tolist(), strict=True))
    assert _chi_square(draws, [expected.get(i, 0.0) for i in range(30)]) < CHI2_5


def test_consecutive_steps_are_independent() -> None:
    """(step n, step n + 1) pairs over many seeds follow the product distribution."""
    probs = [0.4, 0.3, 0.2, 0.1]
    seeds = range(5000)
    logits = torch.tensor([probs]).log().expand(len(seeds), -1)

    def draws(step: int) -> list[int]:
        rows = [RowInput(SamplingParams(do_sample=True, seed=s), range(step + 1), 1) for s in seeds]
        return [c.token_id for c in choose_batched(logits, rows)]

    first, second = draws(0), draws(1)
    pairs = [a * 4 + b for a, b in zip(first, second, strict=True)]
    assert _chi_square(pairs, [p * q for p in probs for q in probs]) < CHI2_15


def test_race_noise_is_exponential() -> None:
    seeds = [seeding.step_seed(s, 0) for s in range(64)]
    keys = torch.tensor([[s & seeding.MASK32, s >> 32] for s in seeds])
    noise = race_noise(keys, 5000)
    assert noise.min() > 0 and noise.isfinite().all()
    assert float(noise.mean()) == pytest.approx(1.0, abs=0.01)
    # P(E > 1) = e^-1, P(E > 3) = e^-3
    assert float((noise > 1).double().mean()) == pytest.approx(math.exp(-1), abs=0.005)
    assert float((noise > 3).double().mean()) == pytest.approx(math.exp(-3), abs=0.002)


def test_race_bits_match_the_pure_python_reference() -> None:
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, seeding.step_seed(42, 7)]
    indices = [0, 1, 2, 1000, 2**24 - 1, 2**24 + 1, 2**31 - 2, 2**31 - 1]
    keys = torch.tensor([[s & seeding.MASK32, s >> 32] for s in seeds])
    got = race_bits(keys, torch.tensor(indices)).tolist()
    assert got == [[seeding.race_bits(s, i) for i in indices] for s in seeds]


# ------------------------------------------------------------------------------ plan and transfer
def test_the_plan_holds_only_the_rows_each_stage_needs() -> None:
    plain = RowInput(SamplingParams(), [1, 2], 1, 2)
    empty = plan_step([plain, plain], VOCAB)
    assert (empty.bias, empty.repetition, empty.frequency, empty.sample) == (None, None, None, None)
    assert len(empty.payload.ints) == len(empty.payload.floats) == 0 and empty.top_n_max == 2
    penalised = RowInput(SamplingParams(repetition_penalty=1.2), [1, 2, 3], 2)
    sampled = RowInput(SamplingParams(do_sample=True, top_k=3), [1], 1)
    plan = plan_step([plain, penalised, sampled], VOCAB)
    assert plan.bias is None and plan.frequency is None  # no output yet / no such penalty
    assert plan.repetition is not None and plan.sample is not None
    assert list(plan.payload.ints[plan.repetition[0].rows.start :][:1]) == [1]
    assert not plan.repetition[0].whole and plan.sample.temperature is None and plan.sample.top_p_drop is None
    assert plan.sample.top_k is not None and plan.sample.top_k_max == 3


def test_the_packed_step_round_trips_exactly() -> None:
    ids = [0, 2**24 - 1, 2**24, 2**24 + 1, 2**31 - 1]
    logprobs = torch.tensor([float("-inf"), -1e-38, -0.0, -87.33654, torch.finfo(torch.float32).min])
    tokens = torch.tensor(ids)
    top_ids = torch.tensor([[i, 2**24 + 3] for i in ids])
    top_lp = torch.stack([logprobs, torch.full((5,), float("-inf"))], dim=1)
    host = to_host(pack_choices(tokens, logprobs, (top_ids, top_lp)))
    choices = unpack_choices(host, [2, 1, 0, 2, 2], width=2)
    assert [c.token_id for c in choices] == ids
    assert [c.logprob for c in choices] == logprobs.tolist()
    assert choices[0].top_ids == (0, 2**24 + 3) and choices[0].top_logprobs == (float("-inf"), float("-inf"))
    assert choices[1].top_ids == (2**24 - 1,) and choices[2].top_ids == ()
    assert choices[4].top_logprobs[0] == torch.finfo(torch.float32).min
    # why float64: float32 cannot hold 2^24 + 1
    assert int(torch.tensor(2**24 + 1, dtype=torch.float32)) != 2**24 + 1
    plain = unpack_choices(to_host(pack_choices(tokens, logprobs, None)), [0] * 5, width=0)
    assert plain == [Choice(i, lp) for i, lp in zip(ids, logprobs.tolist(), strict=True)]


# ------------------------------------------------------------------------------ on a CUDA device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_choose_next_on_cuda_is_the_batched_path_and_reproducible() -> None:
    rows = _random_rows(random.Random(21), 12, VOCAB, top_n=3)
    logits = _logits(len(rows), 21)
    on_cuda = choose_next(logits.cuda(), rows)
    assert on_cuda == choose_next(logits.cuda(), rows)
    on_cpu = choose_batched(logits, rows)
    for row, gpu, cpu in zip(rows, on_cuda, on_cpu, strict=True):
        if not row.params.do_sample:
            assert gpu.token_id == cpu.token_id
        assert gpu.top_logprobs == pytest.approx(cpu.top_logprobs, abs=1e-4)
