"""Request parsing and validation: types, ranges, limits, sampling semantics of each API."""

from __future__ import annotations

import pytest

from router.http.errors import APIError, Flavor
from router.http.info import ServingInfo
from router.http.schemas import ChatCompletionRequest, CompletionRequest, TGIParameters, TGIRequest
from router.http.validation import (
    check_model,
    check_openai_unsupported,
    check_prompt,
    max_new_tokens,
    openai_sampling,
    parse_body,
    stop_sequences,
    tgi_sampling,
)

INFO = ServingInfo(model_id="m", max_input_tokens=10, max_total_tokens=20, default_max_new_tokens=8)
OA, T = Flavor.OPENAI, Flavor.TGI


def _refused(call: object, *args: object) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": "3"}', "max_tokens"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"prompt": "x", "temperature": Infinity}', "temperature"),
        (b'{"prompt": "x", "top_p": 0}', "top_p"),
        (b'{"prompt": "x", "frequency_penalty": -2.5}', "frequency_penalty"),
        (b'{"prompt": "x", "stop": 5}', "stop"),
        (b'{"prompt": "x", "echo": 1}', "echo"),
        (b'{"max_tokens": 3}', "prompt"),
    ],
)
def test_completion_body_type_and_range_errors_name_the_field(raw: bytes, param: str) -> None:
    error = _refused(parse_body, raw, CompletionRequest, OA)
    assert (error.status, error.param) == (400, param)


def test_malformed_or_empty_json_is_a_400() -> None:
    assert _refused(parse_body, b"{", CompletionRequest, OA).code == "invalid_json"
    assert _refused(parse_body, b"  ", CompletionRequest, OA).status == 400
    assert _refused(parse_body, b"[1, 2]", CompletionRequest, OA).status == 400


def test_valid_bodies_parse_and_unknown_fields_are_refused_unless_ignored() -> None:
    raw = b'{"prompt": [1, 2], "temperature": 1, "user": "u", "whatever": {}}'
    error = _refused(parse_body, raw, CompletionRequest, OA)
    assert (error.status, error.param, error.code) == (400, "whatever", "unknown_field")
    body = parse_body(raw, CompletionRequest, OA, ignore_unknown=True)
    assert body.prompt == [1, 2] and body.temperature == 1.0
    nested = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}], "y": 2}]}'
    error = _refused(parse_body, nested, ChatCompletionRequest, OA)
    assert error.status == 400 and error.param is not None and error.param.endswith(("x", "y"))
    assert parse_body(nested, ChatCompletionRequest, OA, ignore_unknown=True).messages[0].text() == "a"
    tgi_raw = b'{"inputs": "hi", "parameters": {"adapter_id": "a"}}'
    assert _refused(parse_body, tgi_raw, TGIRequest, T).status == 400
    assert parse_body(tgi_raw, TGIRequest, T, ignore_unknown=True).inputs == "hi"
    # dropping an unknown field never hides a bad known one
    bad = b'{"prompt": "x", "whatever": 1, "max_tokens": "3"}'
    assert _refused(parse_body, bad, CompletionRequest, OA, True).param == "max_tokens"
    chat = parse_body(
        b'{"messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}',
        ChatCompletionRequest,
        OA,
    )
    assert chat.messages[0].text() == "ab"
    assert _refused(parse_body, b'{"messages": []}', ChatCompletionRequest, OA).param == "messages"
    tgi = parse_body(b'{"inputs": "hi", "parameters": {"top_n_tokens": null, "stop": []}}', TGIRequest, T)
    assert tgi.parameters.max_new_tokens is None


def test_model_name_must_match() -> None:
    check_model(None, INFO)
    check_model("m", INFO)
    error = _refused(check_model, "other", INFO)
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")


def test_openai_unsupported_features() -> None:
    def body(**fields: object) -> CompletionRequest:
        return CompletionRequest.model_validate({"prompt": "x", **fields})

    check_openai_unsupported(body(logit_bias={"3": 1.0}))
    check_openai_unsupported(body(n=2))  # n samples: samples.py
    assert _refused(parse_body, b'{"prompt": "x", "n": 17}', CompletionRequest, OA).param == "n"
    assert _refused(check_openai_unsupported, body(stream_options={"include_usage": True})).status == 400


@pytest.mark.parametrize(
    ("bias", "says"),
    [
        ({"x": 1.0}, "must be token ids"),
        ({"-3": 1.0}, "must be token ids"),
        ({" 3": 1.0}, "must be token ids"),
        ({"50": 1.0}, "outside the vocabulary of 50"),
        ({"3": 100.5}, "[-100, 100]"),
        ({"3": -101.0}, "[-100, 100]"),
    ],
)
def test_openai_logit_bias_is_checked_against_the_vocabulary_and_range(
    bias: dict[str, float], says: str
) -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "logit_bias": bias})
    refused = _refused(openai_sampling, body, 50)
    assert refused.status == 400 and refused.param == "logit_bias" and says in refused.message


def test_openai_logit_bias_becomes_sorted_pairs() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"7": -100, "2": 5.5, "49": 100}})
    assert openai_sampling(body, 50).logit_bias == ((2, 5.5), (7, -100.0), (49, 100.0))
    assert openai_sampling(CompletionRequest.model_validate({"prompt": "x"}), 50).logit_bias == ()


def test_prompt_limits() -> None:
    assert check_prompt([1, 2], INFO, 50, OA) == (1, 2)
    assert _refused(check_prompt, [], INFO, 50, OA).status == 400
    assert _refused(check_prompt, [1, 50], INFO, 50, OA).status == 400
    too_long = _refused(check_prompt, [1] * 11, INFO, 50, T)
    assert (too_long.status, too_long.flavor, too_long.code) == (400, T, "context_length_exceeded")


def test_max_new_tokens_default_is_capped_and_requests_checked() -> None:
    assert max_new_tokens(None, 8, 4, INFO, OA, "max_tokens") == 8
    assert max_new_tokens(None, 8, 15, INFO, OA, "max_tokens") == 5
    assert max_new_tokens(16, 8, 4, INFO, OA, "max_tokens") == 16
    assert _refused(max_new_tokens, 0, 8, 4, INFO, OA, "max_tokens").param == "max_tokens"
    assert _refused(max_new_tokens, -3, 8, 4, INFO, OA, "max_tokens").status == 400
    assert _refused(max_new_tokens, 17, 8, 4, INFO, OA, "max_tokens").code == "context_length_exceeded"
    assert _refused(max_new_tokens, None, 8, 20, INFO, OA, "max_tokens").status == 400


def test_stop_sequences() -> None:
    assert stop_sequences(None, INFO, OA) == ()
    assert stop_sequences("x", INFO, OA) == ("x",)
    assert stop_sequences(["a", "b"], INFO, OA) == ("a", "b")
    assert _refused(stop_sequences, [""], INFO, OA).param == "stop"
    assert _refused(stop_sequences, ["s"] * 9, INFO, OA).status == 400


def test_openai_sampling_temperature_zero_is_greedy_default_samples() -> None:
    greedy = openai_sampling(
        CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "top_p": 0.5}), 50
    )
    assert (greedy.do_sample, greedy.temperature, greedy.top_p) == (False, 1.0, 1.0)
    default = openai_sampling(CompletionRequest.model_validate({"prompt": "x", "seed": 3, "top_k": -1}), 50)
    assert (default.do_sample, default.temperature, default.seed, default.top_k) == (True, 1.0, 3, 0)
    warm = openai_sampling(
        CompletionRequest.model_validate({"prompt": "x", "temperature": 0.7, "frequency_penalty": 1.5}), 50
    )
    assert (warm.temperature, warm.frequency_penalty, warm.repetition_penalty) == (0.7, 1.5, 1.0)


def test_tgi_sampling_warpers_turn_sampling_on() -> None:
    assert tgi_sampling(TGIParameters(), 50).do_sample is False
    assert tgi_sampling(TGIParameters(do_sample=True), 50).do_sample is True
    assert tgi_sampling(TGIParameters(top_k=5), 50).do_sample is True
    assert tgi_sampling(TGIParameters(typical_p=0.9), 50).do_sample is True
    params = tgi_sampling(TGIParameters(repetition_penalty=1.2, seed=9), 50)
    assert (params.do_sample, params.repetition_penalty, params.seed) == (False, 1.2, 9)


def test_serving_info_checks_its_limits() -> None:
    with pytest.raises(ValueError):
        ServingInfo(model_id="m", max_input_tokens=10, max_total_tokens=5)
    with pytest.raises(ValueError):
        ServingInfo(model_id="m", max_input_tokens=0, max_total_tokens=5)
