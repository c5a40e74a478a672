"""No field silently dropped (issue 26 part 1): every field of the OpenAI SDK's request types
(completions and chat, streaming or not), of TGI's `Parameters` (the `text-generation` client and
`huggingface_hub`'s generate parameters and chat input, TGI's own shapes) and of the router's own
request models is either honoured or refused with a 400 naming it.

Honoured means: a request carrying the field's sample value reaches the scheduler as a different
`GenerateRequest`, or gets a different answer, than the same request without it. Refused means a
400 (a 404 for an unknown `model`) that names the field. A field the SDK grows later is refused as
unknown until it is classified here; `--ignore-unknown-fields` drops unknown fields instead.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import ChatCompletionInput, TextGenerationInputGenerateParameters
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from starlette.testclient import TestClient
from text_generation.types import Parameters

from pdcluster.tools.tiny_model import CHAT_TEMPLATE
from router.http import ServingInfo, create_app
from router.http.schemas import ChatCompletionRequest, CompletionRequest, TGIParameters, TGIRequest
from router.tokenizer import Tokenizer
from tests.helpers.fake_scheduler import FakeScheduler
from tests.helpers.router_http import write_word_tokenizer
from tests.unit.router_http import test_router_http_tools

INFO = ServingInfo(model_id="tiny-words", max_input_tokens=32, max_total_tokens=64, default_max_new_tokens=4)
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

# Fields whose effect shows in no single request/answer pair of the fake scheduler; each names the
# test that proves it honoured.
ELSEWHERE = {
    "parallel_tool_calls": (test_router_http_tools, "test_calls_parsed_from_forced_and_auto_outputs"),
}
# OpenAI's own semantics: an opaque end-user identifier for abuse monitoring; it never changes the
# output, and the walk checks that it does not.
NO_EFFECT = frozenset({"user"})

# field -> (sample value, fields added to both the request with it and the one without)
COMPLETION_SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "best_of": (2, {}),
    "echo": (True, {}),
    "frequency_penalty": (0.5, {}),
    "logit_bias": ({"5": 3.0}, {}),
    "logprobs": (2, {}),
    "max_tokens": (2, {}),
    "model": ("another-model", {}),
    "n": (2, {}),
    "presence_penalty": (0.5, {}),
    "prompt": ("the cat", {}),
    "seed": (7, {}),
    "stop": ("w1", {}),
    "stream": (True, {}),
    "stream_options": ({"include_usage": True}, {"stream": True}),
    "suffix": ("w1", {}),
    "temperature": (0.5, {}),
    "top_p": (0.5, {}),
    "user": ("u-1", {}),
    # vLLM-style extensions and structured output
    "top_k": (3, {}),
    "repetition_penalty": (1.3, {}),
    "ignore_eos": (True, {}),
    "min_tokens": (2, {}),
    "response_format": ({"type": "json_object"}, {}),
}
CHAT_SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    **{
        k: COMPLETION_SAMPLES[k]
        for k in (
            "frequency_penalty",
            "logit_bias",
            "max_tokens",
            "model",
            "n",
            "presence_penalty",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "temperature",
            "top_p",
            "user",
            "top_k",
            "repetition_penalty",
            "ignore_eos",
            "min_tokens",
            "response_format",
        )
    },
    "messages": ([{"role": "user", "content": "the cat sat"}], {}),
    "logprobs": (True, {}),
    "top_logprobs": (2, {"logprobs": True}),
    "max_completion_tokens": (2, {}),
    "add_generation_prompt": (False, {}),
    "tools": ([TOOL], {}),
    "tool_choice": ("required", {"tools": [TOOL]}),
    "parallel_tool_calls": (False, {"tools": [TOOL]}),
}
TGI_SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "do_sample": (True, {}),
    "max_new_tokens": (2, {}),
    "repetition_penalty": (1.3, {}),
    "frequency_penalty": (0.5, {}),
    "presence_penalty": (0.5, {}),
    "return_full_text": (True, {}),
    "stop": (["w1"], {}),
    "seed": (7, {}),
    "temperature": (0.5, {}),
    "top_k": (3, {}),
    "top_p": (0.5, {}),
    "truncate": (2, {}),
    "typical_p": (0.5, {}),
    "best_of": (2, {}),
    "watermark": (True, {}),
    "details": (True, {}),
    "decoder_input_details": (True, {"details": True}),
    "top_n_tokens": (2, {"details": True}),
    "grammar": ({"type": "regex", "value": "w[0-9]"}, {}),
}


def _sdk_fields(module: Any) -> set[str]:
    """The request fields of an OpenAI SDK `*_create_params` module (streaming and not)."""
    names: set[str] = set()
    for kind in ("CompletionCreateParamsNonStreaming", "CompletionCreateParamsStreaming"):
        names |= set(typing.get_type_hints(getattr(module, kind)))
    return names


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    folder = write_word_tokenizer(Path(tmp_path_factory.mktemp("words")), chat_template=CHAT_TEMPLATE)
    scheduler = FakeScheduler()
    app = create_app(scheduler, Tokenizer.from_model_dir(folder), INFO, lambda: (b"", "text/plain"))
    test_client = TestClient(app)
    test_client.scheduler = scheduler  # type: ignore[attr-defined]
    return test_client


def _normal(text: str) -> str:
    """An answer without what differs between any two requests (ids, timestamps)."""
    text = re.sub(r'"(id|created|system_fingerprint)":\s*("[^"]*"|\d+)', "", text)
    return re.sub(r'"x-[a-z-]*time[a-z-]*"', "", text)


def _post(client: TestClient, path: str, body: dict[str, Any]) -> tuple[int, str, Any]:
    """(status, normalised answer, the GenerateRequest the scheduler got or None)."""
    scheduler: FakeScheduler = client.scheduler  # type: ignore[attr-defined]
    before = len(scheduler.submitted)
    answer = client.post(path, content=json.dumps(body))
    submitted = scheduler.submitted[before] if len(scheduler.submitted) > before else None
    return answer.status_code, _normal(answer.text), submitted


def _names_field(status: int, text: str, name: str) -> bool:
    if status not in (400, 404):
        return False
    error = json.loads(text)["error"]
    if isinstance(error, dict):  # OpenAI: param names it
        return bool(error["param"] == name or (error["param"] or "").startswith(f"{name}."))
    return name in error  # TGI: the message names it


def _walk(
    client: TestClient,
    path: str,
    base: dict[str, Any],
    fields: set[str],
    samples: dict[str, tuple[Any, dict[str, Any]]],
    wrap: str | None = None,
) -> dict[str, str]:
    """How each field fared: honoured / refused / no effect (asserting one of them)."""
    verdicts: dict[str, str] = {}
    for name in sorted(fields):
        value, extra = samples.get(name, ({"surely": "unsupported"}, {}))
        with_field = {**extra, name: value}
        if wrap is None:
            plain, varied = {**base, **extra}, {**base, **with_field}
        else:
            plain = {**base, wrap: {**base[wrap], **extra}}
            varied = {**base, wrap: {**base[wrap], **with_field}}
        status0, answer0, request0 = _post(client, path, plain)
        assert status0 == 200, (name, answer0)
        status, answer, request = _post(client, path, varied)
        if name in ELSEWHERE:
            module, test = ELSEWHERE[name]
            assert status == 200 and inspect.isfunction(getattr(module, test)), name
            verdicts[name] = "honoured (elsewhere)"
        elif _names_field(status, answer, name):
            verdicts[name] = "refused"
        elif name in NO_EFFECT:
            assert (status, answer, request) == (200, answer0, request0), name
            verdicts[name] = "no effect"
        else:
            assert status == 200, (name, answer)
            assert (request, answer) != (request0, answer0), f"{name} was accepted and dropped"
            verdicts[name] = "honoured"
    return verdicts


def test_every_completion_field_is_honoured_or_refused(client: TestClient) -> None:
    fields = _sdk_fields(completion_params) | set(CompletionRequest.model_fields)
    verdicts = _walk(
        client, "/v1/completions", {"prompt": "hello world", "max_tokens": 4}, fields, COMPLETION_SAMPLES
    )
    assert {k for k, v in verdicts.items() if v == "refused"} == {"best_of", "model", "suffix"}


def test_every_chat_field_is_honoured_or_refused(client: TestClient) -> None:
    fields = _sdk_fields(chat_params) | set(ChatCompletionRequest.model_fields)
    fields |= {f.name for f in dataclasses.fields(ChatCompletionInput)}  # TGI's chat (tool_prompt)
    base = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4}
    verdicts = _walk(client, "/v1/chat/completions", base, fields, CHAT_SAMPLES)
    unknown = fields - set(ChatCompletionRequest.model_fields)
    assert {"functions", "function_call", "audio", "modalities", "store", "metadata"} <= unknown
    assert "tool_prompt" in unknown  # TGI's chat: the tool prompt comes from the model's template
    assert {k for k, v in verdicts.items() if v == "refused"} == unknown | {"model"}


def test_every_tgi_parameter_is_honoured_or_refused(client: TestClient) -> None:
    hub = {f.name for f in dataclasses.fields(TextGenerationInputGenerateParameters)}
    fields = set(Parameters.model_fields) | set(TGIParameters.model_fields) | hub | {"adapter_id"}
    base = {"inputs": "hello world the cat", "parameters": {"max_new_tokens": 4}}
    verdicts = _walk(client, "/generate", base, fields, TGI_SAMPLES, wrap="parameters")
    assert {k for k, v in verdicts.items() if v == "refused"} == {"best_of", "watermark", "adapter_id"}
    top = _walk(
        client,
        "/",
        base,
        set(TGIRequest.model_fields) | {"options"},
        {"inputs": ("the cat", {}), "parameters": ({"max_new_tokens": 2}, {}), "stream": (True, {})},
    )
    # `model` (pdcluster's extension: one of the router's models) names a model this one-model app lacks
    assert top == {"inputs": "honoured", "parameters": "honoured", "stream": "honoured", "options": "refused",
                   "model": "refused"}
    # the routes that fix the answer's shape refuse a `stream` that contradicts it
    assert _names_field(*_post(client, "/generate", {**base, "stream": True})[:2], "stream")
    assert _names_field(*_post(client, "/generate_stream", {**base, "stream": False})[:2], "stream")
    assert _post(client, "/generate_stream", {**base, "stream": True})[0] == 200


def test_unknown_fields_are_dropped_with_the_router_flag(tmp_path: Path) -> None:
    folder = write_word_tokenizer(tmp_path)
    info = ServingInfo(
        model_id="tiny-words", max_input_tokens=32, max_total_tokens=64, ignore_unknown_fields=True
    )
    scheduler = FakeScheduler()
    app = create_app(scheduler, Tokenizer.from_model_dir(folder), info, lambda: (b"", "text/plain"))
    with TestClient(app) as http:
        answer = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "store": True})
        assert answer.status_code == 200
        answer = http.post(
            "/v1/completions", json={"prompt": "hello", "max_tokens": 2, "best_of": 2, "store": True}
        )
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, "best_of")  # still refused
        schema = http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
        assert schema.get("additionalProperties", True) is not False
