"""The OpenAPI document served at /openapi.json (and shown by /docs): every route's request body,
answers, error statuses with their bodies, and content types.

The routes parse their bodies themselves (strict, errors in each API's own shape), so FastAPI
cannot infer any of this; the document is built here from the request models (`schemas.py`), the
answer models (`api_models.py`) and the served model's limits. Limits known when the router
starts (vocabulary, `max_total_tokens`, stop sequences, the model name) are part of the schema;
what depends on tokenization (a text prompt's token count, prompt + max tokens) cannot be, and is
a documented 400 (`context_length_exceeded`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from router.http import api_models as am
from router.http.info import ServingInfo
from router.http.request_schema import RequestLimits, request_schemas

JSON = "application/json"
SSE = "text/event-stream"
REF = "#/components/schemas/{model}"

_ANSWERS: tuple[type[BaseModel], ...] = (
    am.Completion, am.CompletionChunk, am.ChatCompletion, am.ChatCompletionChunk, am.ModelList,
    am.TGIGenerated, am.TGIStreamEvent, am.TGIInfo, am.Health, am.OpenAIError, am.TGIError,
    am.Tokenized, am.Detokenized, am.TGISimpleToken,
)


def ref(name: str) -> dict[str, str]:
    """A reference to a component schema."""
    return {"$ref": REF.format(model=name)}


def _components(limits: RequestLimits) -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in _ANSWERS:
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    schemas.update(request_schemas(limits))
    return schemas


def _error(description: str, flavor: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = ref("OpenAIError" if flavor == "openai" else "TGIError")
    if flavor == "both":  # /tokenize: the error shape of the request's own API
        schema = {"anyOf": [ref("OpenAIError"), ref("TGIError")]}
    answer: dict[str, Any] = {"description": description, "content": {JSON: {"schema": schema}}}
    if headers:
        answer["headers"] = headers
    return answer


_RETRY_AFTER = {"Retry-After": {"required": True, "description": "whole seconds to wait before retrying",
                                "schema": {"type": "integer", "minimum": 1}}}
_AUTHENTICATE = {"WWW-Authenticate": {"required": True, "schema": {"type": "string"},
                                      "description": "`Bearer realm=\"pdcluster\"`"}}

_BAD_REQUEST = (
    "Invalid request, nothing queued: malformed JSON, a wrong type (strict: \"5\" is not a number), a "
    "value out of range, an unsupported feature; or a limit that depends on tokenization: the prompt "
    "over `max_input_tokens`, or prompt + new tokens over `max_total_tokens` (OpenAI code "
    "`context_length_exceeded`); with API keys, a request needing more tokens than its key's tpm "
    "(code `tpm_limit_exceeded`). The scheduler can refuse one too (more KV pages than a replica has)."
)
_FAILED = (
    "The request was accepted but failed: {500: an internal error, 502: a replica failed its batch, "
    "503: no replica can serve (also before queueing)}; streamed requests that fail after their "
    "first event end with one SSE error event in this shape instead."
)


@dataclass(frozen=True)
class _Operation:
    path: str
    method: str
    summary: str
    flavor: str  # "openai", "tgi" or "open" (no error shape of an API, never guarded)
    body: str | None = None  # request component
    json_answer: dict[str, Any] | None = None
    stream_answer: str | None = None  # the component each SSE event's data is
    guarded: bool = False
    generates: bool = False
    not_found: bool = False  # unknown `model`
    query_model: bool = False  # takes `?model=NAME`


_OPERATIONS = (
    _Operation("/v1/completions", "post", "Text completion of one prompt (OpenAI)", "openai",
               "CompletionRequest", {"schema": ref("Completion")}, "CompletionChunk", True, True, True),
    _Operation("/v1/chat/completions", "post", "Chat completion (OpenAI)", "openai",
               "ChatCompletionRequest", {"schema": ref("ChatCompletion")}, "ChatCompletionChunk",
               True, True, True),
    _Operation("/v1/models", "get", "The served model (OpenAI)", "openai", None,
               {"schema": ref("ModelList")}, None, True),
    _Operation("/generate", "post", "Generate, one answer (TGI)", "tgi", "TGIGenerateRequest",
               {"schema": ref("TGIGenerated")}, None, True, True, True),
    _Operation("/generate_stream", "post", "Generate, one SSE event per token (TGI)", "tgi",
               "TGIStreamRequest", None, "TGIStreamEvent", True, True, True),
    _Operation("/", "post", "TGI compat: a one-element list, or the stream with `stream: true`", "tgi",
               "TGIRequest", {"schema": {"type": "array", "items": ref("TGIGenerated"), "minItems": 1,
                                         "maxItems": 1}}, "TGIStreamEvent", True, True, True),
    _Operation("/tokenize", "post", "Token ids of a prompt or of chat messages (vLLM: `prompt` / "
               "`messages`), or tokens with their offsets (TGI: `inputs`)", "both", "TokenizeRequest",
               {"schema": {"anyOf": [ref("Tokenized"), {"type": "array", "items": ref("TGISimpleToken")}]}},
               not_found=True),
    _Operation("/detokenize", "post", "The text of token ids (vLLM)", "openai", "DetokenizeRequest",
               {"schema": ref("Detokenized")}, not_found=True),
    _Operation("/info", "get", "The model and the limits this router enforces (TGI); `?model=` another "
               "served model (a pdcluster extension)", "open", None, {"schema": ref("TGIInfo")},
               not_found=True, query_model=True),
)


def _answers(op: _Operation, keys: bool) -> dict[str, Any]:
    content: dict[str, Any] = {}
    if op.json_answer is not None:
        content[JSON] = op.json_answer
    if op.stream_answer is not None:
        content[SSE] = {"schema": _event_schema(op)}
    answers: dict[str, Any] = {"200": {"description": _ok_description(op), "content": content}}
    if op.body is not None:
        answers["400"] = _error(_BAD_REQUEST, op.flavor)
    if op.not_found:
        answers["404"] = _error("`model` names another model than the served one (code "
                                "`model_not_found`)", op.flavor)
    if op.guarded and keys:
        answers["401"] = _error("No API key, or an unknown one (code `missing_api_key` / "
                                "`invalid_api_key`)", op.flavor, _AUTHENTICATE)
        answers["429"] = _error("A limit of the key: requests per minute, concurrent requests or tokens "
                                "per minute (code `rpm_limit_exceeded`, `concurrent_limit_exceeded`, "
                                "`tpm_limit_exceeded`)", op.flavor, _RETRY_AFTER)
    if op.generates:
        for status in ("500", "502", "503"):
            answers[status] = _error(_FAILED, op.flavor)
    return answers


def _event_schema(op: _Operation) -> dict[str, Any]:
    """One server-sent event: its `data` is a JSON chunk, or the error that ended the stream (and,
    OpenAI only, the final `[DONE]`)."""
    assert op.stream_answer is not None
    error = "OpenAIError" if op.flavor == "openai" else "TGIError"
    chunk = {"type": "string", "contentMediaType": JSON,
             "contentSchema": {"anyOf": [ref(op.stream_answer), ref(error)]}}
    data = {"if": {"const": "[DONE]"}, "else": chunk} if op.flavor == "openai" else chunk
    done = ", then `data: [DONE]`" if op.flavor == "openai" else ""
    return {"type": "object", "required": ["data"], "properties": {"data": data},
            "description": f"`data: <{op.stream_answer}>` per event{done}; a failure mid-stream is one "
                           f"`data: <{error}>` event, and the stream ends"}


def _ok_description(op: _Operation) -> str:
    if op.json_answer is not None and op.stream_answer is not None:
        return f"`{JSON}`, or `{SSE}` when the body says `stream: true`"
    return "the answer"


def _operation(op: _Operation, keys: bool, links: dict[str, Any],
               model_ids: tuple[str, ...]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "summary": op.summary,
        "operationId": op.method + op.path.replace("/", "_").rstrip("_") if op.path != "/" else "post_compat",
        "tags": ["OpenAI" if op.flavor == "openai" else "TGI"],
        "responses": _answers(op, keys),
    }
    if op.body is not None:
        doc["requestBody"] = {"required": True, "content": {JSON: {"schema": ref(op.body)}}}
    if op.query_model:
        doc["parameters"] = [{"name": "model", "in": "query", "required": False,
                              "schema": {"type": "string", "enum": list(model_ids)},
                              "description": "a served model (absent: the default one)"}]
    if op.guarded and keys:
        doc["security"] = [{"apiKey": []}]
    if op.path in links:
        doc["responses"]["200"]["links"] = links[op.path]
    return doc


def _links() -> dict[str, Any]:
    """Follow-up calls for stateful testing (and readers): the model list names the model to ask
    for; an answer's text continues as the next prompt or chat turn."""
    model_id = "$response.body#/data/0/id"
    return {
        "/v1/models": {
            "CompleteWithListedModel": {"operationId": "post_v1_completions",
                                        "requestBody": {"model": model_id}},
            "ChatWithListedModel": {"operationId": "post_v1_chat_completions",
                                    "requestBody": {"model": model_id}},
        },
        "/v1/completions": {
            "ChatAboutCompletion": {"operationId": "post_v1_chat_completions", "requestBody": {
                "messages": [{"role": "user", "content": "$response.body#/choices/0/text"}]}},
        },
        "/v1/chat/completions": {
            "ContinueChat": {"operationId": "post_v1_chat_completions", "requestBody": {
                "messages": [{"role": "assistant", "content": "$response.body#/choices/0/message/content"},
                             {"role": "user", "content": "go on"}]}},
        },
        "/generate": {
            "ChatAboutGenerated": {"operationId": "post_v1_chat_completions", "requestBody": {
                "messages": [{"role": "user", "content": "$response.body#/generated_text"}]}},
        },
    }


def _plain(path: str, summary: str, answers: dict[str, Any]) -> dict[str, Any]:
    return {"get": {"summary": summary, "operationId": "get" + path.replace("/", "_"),
                    "tags": ["Operations"], "responses": answers}}


def build_openapi(title: str, info: ServingInfo, vocab_size: int, keys: bool,
                  more_model_ids: tuple[str, ...] = ()) -> dict[str, Any]:
    """The whole document for this router: its model's limits (`model` may also name `more_model_ids`),
    and auth when `keys` are configured."""
    limits = RequestLimits.of(info, vocab_size, more_model_ids)
    links = _links()
    paths: dict[str, Any] = {}
    for op in _OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, keys, links,
                                                              (info.model_id, *more_model_ids))
    paths["/health"] = _plain("/health", "Whether a replica can serve", {
        "200": {"description": "serving", "content": {JSON: {"schema": ref("Health")}}},
        "503": {"description": "no replica can serve", "content": {JSON: {"schema": ref("Health")}}},
    })
    paths["/metrics"] = _plain("/metrics", "Prometheus metrics", {
        "200": {"description": "the Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}}},
    })
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": info.version, "description": _description(keys)},
        "paths": paths,
        "components": {"schemas": _components(limits)},
    }
    if keys:
        doc["components"]["securitySchemes"] = {"apiKey": {
            "type": "http", "scheme": "bearer",
            "description": "an API key of the router's --api-keys file"}}
    return copy.deepcopy(doc)


def _description(keys: bool) -> str:
    auth = (
        "Every /v1 and TGI generation route needs `Authorization: Bearer KEY`; /health, /metrics, "
        "/info, /docs and /openapi.json are open."
        if keys
        else "Served without API keys: every route is open."
    )
    return (
        "OpenAI- and TGI-compatible generation over a cluster of prefill and decode replicas. "
        "Request bodies are strict JSON (a wrong type is a 400, not coerced); every field is "
        f"honoured or refused with a 400 naming it, unknown ones too. {auth}"
    )
