"""A sampler no valid-looking input breaks (issue 26 part 8): Hypothesis drives the engine's token
choice directly, through the CPU's per-row path (`choose_next`) and the batched path
(`choose_batched`, here on CPU tensors), with every sampling parameter the replica accepts
(`replica/engine/validation.check_sampling`): denormal and extreme temperatures and penalties,
logit biases, frequency / presence penalties, top-k / top-p / typical-p, float32 and bfloat16
logits with extreme values, and rows a grammar mask left with a few allowed tokens (-inf
elsewhere; real xgrammar masks: tests/component/engine/test_sampling_fuzz_grammar.py). Every
choice is an allowed token with a log-probability that is not NaN.

The regression that started it (a Schemathesis run through the router): `repetition_penalty`
2.2250738585e-313 (the router brings it to the smallest normal float32), `frequency_penalty` 0.26
and a `logit_bias`: the penalty divided a positive logit into +inf and the draw failed the batch.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.engine.device_sampling import choose_batched
from replica.engine.finite import saturate
from replica.engine.sampling import choose_next
from replica.engine.types import Choice, RowInput, SamplingParams
from router.http.validation import F32_TINY

F32_MAX = 3.4028234663852886e38
DENORMAL = 1.401298464324817e-45  # the smallest positive float32
POSITIVE = st.one_of(
    st.floats(min_value=DENORMAL, max_value=F32_MAX, allow_subnormal=True, width=32),
    st.sampled_from([1e-45, F32_TINY, 1e-5, 1.0, 2.0, 1e30, F32_MAX]),
)
FINITE = st.one_of(
    st.floats(min_value=-F32_MAX, max_value=F32_MAX, allow_subnormal=True, width=32),
    st.sampled_from([0.0, -2.0, 0.26, 2.0, -F32_MAX, F32_MAX]),
)
FRACTION = st.one_of(
    st.floats(min_value=DENORMAL, max_value=1.0, allow_subnormal=True, width=32),
    st.sampled_from([1e-45, 0.5, 1.0]),
)
LOGIT = st.one_of(
    st.floats(min_value=-1e4, max_value=1e4, width=32),
    st.sampled_from([0.0, 1e-45, -1e-45, 3e38, -3e38, 1e30, -1e30]),
)


@st.composite
def rows(draw: st.DrawFn, vocab: int) -> tuple[list[float], RowInput]:
    """(one row of logits, -inf where a grammar mask refused a token; its request)."""
    logits = draw(st.lists(LOGIT, min_size=vocab, max_size=vocab))
    if draw(st.booleans()):  # a grammar mask: a few allowed tokens, the others -inf
        allowed = draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=3))
        logits = [x if i in allowed else -math.inf for i, x in enumerate(logits)]
    bias = draw(st.dictionaries(st.integers(0, vocab - 1), st.floats(-100.0, 100.0), max_size=4))
    params = SamplingParams(
        do_sample=draw(st.booleans()),
        temperature=draw(POSITIVE),
        top_k=draw(st.integers(0, vocab + 2)),
        top_p=draw(FRACTION),
        typical_p=draw(FRACTION),
        seed=draw(st.integers(0, 2**64 - 1)),
        repetition_penalty=draw(POSITIVE),
        frequency_penalty=draw(FINITE),
        presence_penalty=draw(FINITE),
        logit_bias=tuple(sorted(bias.items())),
    )
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    output = draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    top_n = draw(st.integers(0, 3))
    return logits, RowInput(params, (*prompt, *output), len(prompt), top_n)


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[RowInput]]:
    vocab = draw(st.integers(2, 24))
    drawn = draw(st.lists(rows(vocab), min_size=1, max_size=4))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    logits = torch.tensor([row for row, _ in drawn], dtype=torch.float32).to(dtype)
    return logits, [inp for _, inp in drawn]


def _check(choices: list[Choice], logits: torch.Tensor, inputs: list[RowInput]) -> None:
    assert len(choices) == len(inputs)
    for choice, row, inp in zip(choices, logits.float(), inputs, strict=True):
        assert 0 <= choice.token_id < row.shape[0]
        assert row[choice.token_id] != -math.inf, "a token the mask refused was chosen"
        assert not math.isnan(choice.logprob) and choice.logprob <= 0.0
        assert len(choice.top_ids) == min(inp.top_n, row.shape[0])
        assert not any(math.isnan(lp) for lp in choice.top_logprobs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_no_valid_looking_input_breaks_the_sampler(batch: tuple[torch.Tensor, list[RowInput]]) -> None:
    logits, inputs = batch
    _check(choose_next(logits, inputs), logits, inputs)
    _check(choose_batched(logits, inputs), logits, inputs)


def test_the_schemathesis_regression_samples_and_is_greedy_exact() -> None:
    logits = torch.tensor([[2.0, -1.0, 5.0, 0.5, -3.0, 1.0]])
    for do_sample in (False, True):
        params = SamplingParams(
            do_sample=do_sample,
            seed=3,
            repetition_penalty=F32_TINY,
            frequency_penalty=0.26,
            logit_bias=((0, 1.0), (5, -2.0)),
        )
        inputs = [RowInput(params, (1, 2, 3, 0, 2), 3, top_n=2)]
        for choices in (choose_next(logits, inputs), choose_batched(logits, inputs)):
            _check(choices, logits, inputs)
            # the seen positives divided by 1.2e-38: 0 (2 + bias 1) -> 2.6e38, 3 -> 4.3e37, 2 -> past
            # the float32 maximum, saturated there: 2 wins, and every other token has probability 0
            assert (choices[0].token_id, choices[0].logprob) == (2, 0.0)
            assert choices[0].top_ids == (2, 0) and math.isfinite(choices[0].top_logprobs[1])


def test_saturate_keeps_removed_tokens_removed() -> None:
    old = torch.tensor([1.0, -math.inf, 3e38, -3e38])
    new = torch.tensor([math.inf, -math.inf, math.inf, -math.inf])
    assert saturate(new, old).tolist() == [F32_MAX, -math.inf, F32_MAX, -F32_MAX]
    assert saturate(new.bfloat16(), old.bfloat16()).float().tolist()[1] == -math.inf
