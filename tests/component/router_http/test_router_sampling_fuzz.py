"""A sampler no valid-looking input breaks, end to end (issue 26 part 8): Hypothesis draws every
sampling field of the OpenAI completions and chat requests and of TGI's parameters (denormals,
64-bit extremes past float32, negatives, zeros, logit biases; the Schemathesis case among them),
posts them to the router's front end, and each value is either refused with a 400 naming a drawn
field, or the request the scheduler got crosses the wire as the router sends it (`batch_pb`), is
accepted by the replica's own check (`check_sampling`) and drives both sampling paths without NaN.

The engine's side alone, with grammar masks and bfloat16 logits: tests/unit/engine/test_sampling_fuzz.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from replica.engine.device_sampling import choose_batched
from replica.engine.sampling import choose_next
from replica.engine.types import RowInput
from replica.engine.validation import check_sampling
from replica.server.convert import sampling_from_pb
from router.client import batch_pb
from router.http import ServingInfo, create_app
from router.tokenizer import Tokenizer
from router.types import BatchId, BatchSpec, RequestId, WireRequest
from tests.helpers.fake_scheduler import FakeScheduler
from tests.helpers.router_http import write_word_tokenizer

VOCAB = 200  # write_word_tokenizer's model
INFO = ServingInfo(model_id="tiny-words", max_input_tokens=16, max_total_tokens=40, default_max_new_tokens=4)

# a number as a client might send it: ordinary, denormal (float32's and float64's), past float32,
# negative, zero, a whole number
NUMBER = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 1.0, 0.26, 2.2250738585e-313, 1e-45, 1e-39, 3.4e38, 3.5e38, 1e300, -2.0]),
    st.integers(-5, 5),
    st.floats(min_value=0.0, max_value=2.0, allow_subnormal=True),  # mostly in range, so most
    st.floats(min_value=0.0, max_value=1.0, allow_subnormal=True),  # requests reach the sampler
)
BIAS = st.dictionaries(
    st.one_of(st.integers(0, 250).map(str), st.sampled_from(["000000297", "0005", "007"])),
    NUMBER,
    max_size=3,
)
OPENAI_FIELDS = ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty",
                 "repetition_penalty")
TGI_FIELDS = (*OPENAI_FIELDS, "typical_p")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[TestClient, FakeScheduler]:
    tokenizer = Tokenizer.from_model_dir(write_word_tokenizer(Path(tmp_path_factory.mktemp("words"))))
    scheduler = FakeScheduler()
    return TestClient(create_app(scheduler, tokenizer, INFO, lambda: (b"", "text/plain"))), scheduler


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any], set[str]]:
    """(route, body, the sampling fields drawn)."""
    route = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]))
    names = TGI_FIELDS if route == "/generate" else OPENAI_FIELDS
    chosen = draw(st.sets(st.sampled_from(names), min_size=1, max_size=3))
    fields: dict[str, Any] = {name: draw(NUMBER) for name in sorted(chosen)}
    if draw(st.booleans()):
        fields["seed"] = draw(st.integers(0, 2**64 - 1))
    if route == "/generate":
        fields["do_sample"] = draw(st.booleans())
        return route, {"inputs": "the cat sat", "parameters": {**fields, "max_new_tokens": 2}}, set(fields)
    if draw(st.booleans()):
        fields["logit_bias"] = draw(BIAS)
    body = {**fields, "max_tokens": 2}
    if route == "/v1/completions":
        return route, {**body, "prompt": "the cat sat"}, set(fields)
    return route, {**body, "messages": [{"role": "user", "content": "the cat sat"}]}, set(fields)


def _named(answer: dict[str, Any]) -> str:
    """The field a 400 names (OpenAI: `param`; TGI: the message)."""
    error = answer["error"]
    return str(error["param"]) if isinstance(error, dict) else str(error)


@settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(drawn=bodies(), seed=st.integers(0, 2**31 - 1))
def test_every_sampling_value_is_refused_by_name_or_sampled_without_nan(
    served: tuple[TestClient, FakeScheduler], drawn: tuple[str, dict[str, Any], set[str]], seed: int
) -> None:
    client, scheduler = served
    route, body, fields = drawn
    before = len(scheduler.submitted)
    answer = client.post(route, content=json.dumps(body))
    event(f"{route} {answer.status_code}")
    if answer.status_code == 400:
        named = _named(answer.json())
        assert any(name in named for name in fields), (named, body)
        return
    assert answer.status_code == 200, (answer.status_code, answer.text, body)
    request = scheduler.submitted[before]
    wire = batch_pb(BatchSpec(BatchId(1), (WireRequest(RequestId(1), request),), max_tokens=40)).requests[0]
    params = sampling_from_pb(wire.parameters)
    check_sampling(params, "fuzz")  # the replica would not refuse the batch
    vocab = VOCAB
    generator = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(2, vocab, generator=generator) * 8).to(dtype)
        tokens = (*wire.input_tokens, 3, 3, 5)
        rows = [RowInput(params, tokens, len(wire.input_tokens), top_n=2)] * 2
        for choices in (choose_next(logits, rows), choose_batched(logits, rows)):
            for choice in choices:
                assert 0 <= choice.token_id < vocab
                assert not math.isnan(choice.logprob), (body, params)
                assert not any(math.isnan(lp) for lp in choice.top_logprobs), (body, params)
