"""Events → OpenAI and TGI shapes, SSE framing, error bodies, timing headers."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from router.http.errors import Flavor, error_body
from router.http.events import failed_event, sse
from router.http.openai_format import OpenAIAnswer, OpenAIContext
from router.http.tgi_format import TGIContext, Timeline, generate_object, stream_object
from router.types import (
    ErrorEvent,
    FinishEvent,
    FinishReason,
    PrefillEvent,
    ReplicaId,
    Route,
    TokenEvent,
    TokenInfo,
    TopToken,
)

ROUTE = Route(ReplicaId(2), ReplicaId(5), "full", 1024, 0.5)


def _tok(i: int, text: str, special: bool = False, lp: float = -0.25) -> TokenInfo:
    return TokenInfo(
        id=i, text=text, logprob=lp, special=special, top=(TopToken(i, text, lp), TopToken(9, "z", -3.0))
    )


def _finish(text: str, reason: FinishReason = FinishReason.LENGTH, n: int = 2) -> FinishEvent:
    return FinishEvent(text=text, reason=reason, generated_tokens=n, prompt_tokens=3, seed=4, route=ROUTE)


def _ctx(chat: bool, **kw: object) -> OpenAIContext:
    return OpenAIContext(request_id="id-1", model="m", created=7, chat=chat, **kw)  # type: ignore[arg-type]


def test_sse_framing() -> None:
    assert sse('{"a":1}') == 'data: {"a":1}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"
    event = failed_event(ErrorEvent("replica down", 503), Flavor.OPENAI)
    assert event.startswith("data: ") and event.endswith("\n\n")
    body = json.loads(event[len("data: ") :])
    assert (
        body["error"]["message"] == "generation failed: replica down"
        and body["error"]["type"] == "server_error"
    )
    tgi = json.loads(failed_event(ErrorEvent("x"), Flavor.TGI)[6:])
    assert tgi == {"error": "generation failed: x", "error_type": "generation"}


def test_error_bodies() -> None:
    assert error_body("m", 404, Flavor.OPENAI, "model", "c") == {
        "error": {"message": "m", "type": "not_found_error", "param": "model", "code": "c"}
    }
    assert error_body("m", 400, Flavor.TGI) == {"error": "m", "error_type": "validation"}


def test_chat_answer_non_stream_with_logprobs_and_route() -> None:
    answer = OpenAIAnswer(_ctx(True, logprobs=True))
    answer.on_prefill(PrefillEvent())
    answer.on_token(TokenEvent(_tok(5, " hi"), 0))
    answer.on_token(TokenEvent(_tok(2, "</s>", special=True, lp=-math.inf), 1))
    answer.on_finish(_finish(" hi", FinishReason.EOS_TOKEN))
    body = answer.final_object()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " hi"} and choice["finish_reason"] == "stop"
    entries = choice["logprobs"]["content"]
    assert entries[0]["bytes"] == [32, 104, 105] and entries[0]["top_logprobs"][1]["token"] == "z"
    assert entries[1]["logprob"] == -9999.0  # -inf is not JSON
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["pdcluster_route"]["decode_replica"] == 5
    json.dumps(body, allow_nan=False)


def test_completion_stream_chunks_hold_back_stop_text() -> None:
    answer = OpenAIAnswer(_ctx(False, stops=("STOP",), include_usage=True))
    assert answer.on_token(TokenEvent(_tok(1, " a S"), 0)) == " a "
    chunk = answer.chunk(" a ", [])
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == " a "
    assert chunk["usage"] is None and chunk["choices"][0]["finish_reason"] is None
    assert answer.on_token(TokenEvent(_tok(2, "TOP b"), 1)) == ""
    final = answer.final_chunk(answer.on_finish(_finish(" a STOP b", FinishReason.STOP_SEQUENCE)))
    assert final["choices"][0] == {"index": 0, "logprobs": None, "text": "", "finish_reason": "stop"}
    assert final["pdcluster_route"]["migration_bytes"] == 1024
    assert answer.usage_chunk()["choices"] == [] and answer.usage_chunk()["usage"]["total_tokens"] == 5
    assert answer.final_object()["choices"][0]["text"] == " a "


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache() -> None:
    answer = OpenAIAnswer(_ctx(True, include_usage=True))
    answer.on_prefill(PrefillEvent())
    answer.on_token(TokenEvent(_tok(5, " hi"), 0))
    finish = FinishEvent(text=" hi", reason=FinishReason.LENGTH, generated_tokens=1, prompt_tokens=40,
                         route=dataclasses.replace(ROUTE, cached_tokens=32))
    answer.final_chunk(answer.on_finish(finish))
    for usage in (answer.usage_chunk()["usage"], answer.final_object()["usage"]):
        assert usage["prompt_tokens_details"] == {"cached_tokens": 32} and usage["prompt_tokens"] == 40
    assert answer.final_object()["pdcluster_route"]["cached_tokens"] == 32


def test_completion_echo_logprobs_cover_prompt_then_completion() -> None:
    answer = OpenAIAnswer(_ctx(False, logprobs=True, echo="ab"))
    prompt = (TokenInfo(1, "a", 0.0), TokenInfo(2, "b", -1.0))
    answer.on_prefill(PrefillEvent(prompt))
    answer.on_token(TokenEvent(_tok(3, "c"), 0))
    answer.on_finish(_finish("c", n=1))
    choice = answer.final_object()["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"]["tokens"] == ["a", "b", "c"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -0.25]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]
    assert choice["logprobs"]["top_logprobs"][2] == {"c": -0.25, "z": -3.0}


def test_tgi_objects() -> None:
    ctx = TGIContext(details=True, decoder_input_details=True, top_n_tokens=2, prefix="P:", input_length=3)
    tokens = [_tok(5, " x"), _tok(6, " y")]
    body = generate_object(ctx, _finish(" x y"), tokens, (TokenInfo(1, "<s>", 0.0), TokenInfo(7, "q", -2.0)))
    assert body["generated_text"] == "P: x y"
    details = body["details"]
    assert details["finish_reason"] == "length" and details["seed"] == 4
    assert details["prefill"] == [
        {"id": 1, "text": "<s>", "logprob": None},
        {"id": 7, "text": "q", "logprob": -2.0},
    ]
    assert details["tokens"][0] == {"id": 5, "text": " x", "logprob": -0.25, "special": False}
    assert len(details["top_tokens"]) == 2 and details["top_tokens"][0][1]["text"] == "z"
    plain = generate_object(TGIContext(False, False, 0, "", 3), _finish(" x y"), tokens, ())
    assert set(plain) == {"generated_text", "pdcluster_route"}
    mid = stream_object(ctx, TokenEvent(tokens[0], 0))
    assert mid["generated_text"] is None and mid["details"] is None and len(mid["top_tokens"]) == 2
    last = stream_object(ctx, TokenEvent(tokens[1], 1), _finish(" x y"))
    assert last["generated_text"] == "P: x y" and last["details"]["input_length"] == 3
    assert last["pdcluster_route"]["prefill_replica"] == 2


def test_timeline_headers() -> None:
    timeline = Timeline(received=100.0, validated=100.01, token_times=[100.2, 100.25, 100.45])
    headers = timeline.headers("r", input_length=3, output_length=3, characters=9)
    assert headers["x-first-token-time"] == "200"
    assert headers["x-first-decode-token-time"] == "50"
    assert headers["x-max-time-between-tokens"] == "200"
    assert headers["x-max-time-between-tokens-except-first"] == "200"
    assert headers["x-avg-time-between-tokens"] == "125"
    assert headers["x-validation-time"] == "10"
    assert headers["x-input-length"] == "3" and headers["x-output-length"] == "3"
    assert "x-first-token-time" not in Timeline(received=0.0).headers("r", 1, 0, 0)


def test_completion_echo_logprobs_skip_special_prompt_tokens() -> None:
    answer = OpenAIAnswer(_ctx(False, logprobs=True, echo="ab"))
    prompt = (TokenInfo(1, "<s>", 0.0, special=True), TokenInfo(5, "a", -2.0), TokenInfo(6, "b", -1.0))
    answer.on_prefill(PrefillEvent(prompt))
    answer.on_finish(_finish("", n=0))
    logprobs = answer.final_object()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b"] and logprobs["token_logprobs"] == [-2.0, -1.0]
    assert logprobs["text_offset"] == [0, 1]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("logprobs", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_prebuilt_token_chunk_equals_the_plain_chunk(chat: bool, logprobs: bool, include_usage: bool) -> None:
    answer = OpenAIAnswer(_ctx(chat, logprobs=logprobs, include_usage=include_usage, echo=None))
    token = _tok(5, ' "quoted" ünï')
    piece = answer.on_token(TokenEvent(token, 0))
    assert json.loads(answer.token_chunk_json(piece, token)) == answer.chunk(piece, [token])


@pytest.mark.parametrize("logprob", [-0.123456789, 0.0, -1e-20, float("-inf")])
def test_direct_token_logprobs_text_equals_the_encoder(logprob: float) -> None:
    answer = OpenAIAnswer(_ctx(False, logprobs=True, echo=None))
    for token in (TokenInfo(5, 'hé"\n', logprob), TokenInfo(6, "", logprob, special=True)):
        direct = answer._token_logprobs_json(token, 17)
        assert direct == json.dumps(answer._logprobs([token], 17), ensure_ascii=False, separators=(",", ":"))
