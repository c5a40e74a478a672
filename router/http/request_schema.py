"""JSON schemas of the request bodies as this router accepts them: the pydantic models of
`schemas.py` plus the limits `validation.py` checks that are known when the router starts.

A request valid against these schemas is refused only for what depends on tokenization (a text
prompt's token count against `max_input_tokens`, prompt + new tokens against `max_total_tokens`),
and a request invalid against them is always refused: the Schemathesis tests hold the server to
both.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from router.http.info import ServingInfo
from router.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TGIRequest,
    TGITokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from router.http.validation import LOGIT_BIAS_LIMIT

REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class RequestLimits:
    """What bounds a request body before tokenization."""

    model_id: str
    vocab_size: int
    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int
    max_top_n_tokens: int
    ignore_unknown_fields: bool = False  # the schemas then admit additional properties
    more_model_ids: tuple[str, ...] = ()  # the router's further models (`--models`)

    @classmethod
    def of(cls, info: ServingInfo, vocab_size: int, more_model_ids: tuple[str, ...] = ()) -> RequestLimits:
        """The limits of a router serving `info` (and `more_model_ids`), tokenizer of `vocab_size` ids."""
        return cls(info.model_id, vocab_size, info.max_input_tokens, info.max_total_tokens,
                   info.max_stop_sequences, info.max_top_n_tokens, info.ignore_unknown_fields, more_model_ids)

    @property
    def model_ids(self) -> list[str]:
        """Every model a request may name."""
        return [self.model_id, *self.more_model_ids]


def below_regex(limit: int) -> str:
    """A regex of the decimal numbers in [0, limit) (leading zeros allowed, as `int()` reads them)."""
    top = str(limit - 1)
    k = len(top)
    shorter = ["[0-9]"] + [f"[1-9][0-9]{{{n - 1}}}" for n in range(2, k)]
    same = []
    for i, digit in enumerate(top):
        low = 1 if i == 0 and k > 1 else 0
        if int(digit) > low:
            same.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{k - i - 1}}}" if k - i > 1 else ""))
    same.append(top)
    alternatives = (shorter if k > 1 else []) + same
    return f"^0*(?:{'|'.join(alternatives)})$"


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _token_ids(limits: RequestLimits) -> dict[str, Any]:
    return {"type": "array", "minItems": 1, "maxItems": limits.max_input_tokens,
            "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}}


def _stops(limits: RequestLimits, allow_string: bool) -> dict[str, Any]:
    one = {"type": "string", "minLength": 1}
    listed = {"type": "array", "maxItems": limits.max_stop_sequences, "items": one}
    return {"anyOf": [one, listed, {"type": "null"}]} if allow_string else listed


def _max_new(limits: RequestLimits, description: str) -> dict[str, Any]:
    bounded = {"type": "integer", "minimum": 1, "maximum": limits.max_total_tokens - 1}
    return {**_nullable(bounded), "description": description}


_MAX_NEW = "tokens to generate; prompt tokens + this must be <= max_total_tokens"


def _openai_common(props: dict[str, Any], limits: RequestLimits) -> None:
    props["model"] = {**_nullable({"type": "string", "enum": limits.model_ids}),
                      "description": "the served model (absent = it)"}
    props["max_tokens"] = _max_new(limits, _MAX_NEW)
    props["stop"] = _stops(limits, allow_string=True)
    props["n"] = {"type": "integer", "enum": [1], "default": 1, "description": "only 1 is supported"}
    props["logit_bias"] = _nullable({
        "type": "object",
        "propertyNames": {"pattern": below_regex(limits.vocab_size)},
        "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT, "maximum": LOGIT_BIAS_LIMIT},
        "description": "token id (a decimal string) -> bias added to its logit",
    })


# stream_options only with stream: true
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def _completion(schema: dict[str, Any], limits: RequestLimits) -> None:
    props = schema["properties"]
    _openai_common(props, limits)
    one_text = {"type": "string", "minLength": 1}
    props["prompt"] = {
        "description": "one prompt: text, token ids, or a one-element list of either",
        "anyOf": [
            one_text,
            _token_ids(limits),
            {"type": "array", "minItems": 1, "maxItems": 1, "items": one_text},
            {"type": "array", "minItems": 1, "maxItems": 1, "items": _token_ids(limits)},
        ],
    }
    props["best_of"] = _nullable({"type": "integer", "enum": [1]})
    props["suffix"] = {**_nullable({"type": "string", "maxLength": 0}), "description": "not supported"}
    schema.update(_STREAM_OPTIONS_NEED_STREAM)


def _chat(schema: dict[str, Any], limits: RequestLimits) -> None:
    props = schema["properties"]
    _openai_common(props, limits)
    props["max_completion_tokens"] = _max_new(limits, _MAX_NEW + " (wins over max_tokens)")
    schema.update(_STREAM_OPTIONS_NEED_STREAM)


def _tgi_parameters(schema: dict[str, Any], limits: RequestLimits) -> None:
    props = schema["properties"]
    props["max_new_tokens"] = _max_new(limits, _MAX_NEW + " (absent: the router's default, capped)")
    props["stop"] = _stops(limits, allow_string=False)
    props["best_of"] = _nullable({"type": "integer", "enum": [1]})
    props["watermark"] = {"type": "boolean", "enum": [False], "default": False,
                          "description": "not supported"}
    props["grammar"] = {"type": "null", "description": "not supported"}
    props["top_n_tokens"] = _nullable({"type": "integer", "minimum": 0, "maximum": limits.max_top_n_tokens})


def _integer_bounds(node: Any) -> None:
    """`exclusiveMinimum: 0` of an integer as `minimum: 1` (the same set; generators and readers
    handle the inclusive form better)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            if "exclusiveMinimum" in node:
                node["minimum"] = node.pop("exclusiveMinimum") + 1
            if "exclusiveMaximum" in node:
                node["maximum"] = node.pop("exclusiveMaximum") - 1
        for child in node.values():
            _integer_bounds(child)
    elif isinstance(node, list):
        for child in node:
            _integer_bounds(child)


def _schema(model: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any]]:
    schema = model.model_json_schema(ref_template=REF)
    _integer_bounds(schema)
    return schema, schema.pop("$defs", {})


def _tokenizer_schemas(out: dict[str, dict[str, Any]], limits: RequestLimits) -> None:
    """/tokenize (vLLM's two shapes and TGI's, told apart by `prompt` / `messages` / `inputs`) and
    /detokenize (ids within the vocabulary)."""
    model = {**_nullable({"type": "string", "enum": limits.model_ids}), "description": "the served model"}
    shapes = []
    for kind in (TokenizeCompletionRequest, TokenizeChatRequest, TGITokenizeRequest):
        schema, defs = _schema(kind)
        if "model" in schema["properties"]:
            schema["properties"]["model"] = model
        out.update(defs)
        out[kind.__name__] = schema
        shapes.append({"$ref": REF.format(model=kind.__name__)})
    out["TokenizeRequest"] = {"oneOf": shapes, "examples": [{"prompt": "Once upon a time"}]}
    detokenize, defs = _schema(DetokenizeRequest)
    detokenize["properties"]["model"] = model
    detokenize["properties"]["tokens"] = {"type": "array", "maxItems": limits.max_total_tokens,
                                          "items": {"type": "integer", "minimum": 0,
                                                    "maximum": limits.vocab_size - 1}}
    detokenize["examples"] = [{"tokens": [1, 2, 3]}]
    out["DetokenizeRequest"] = detokenize


def request_schemas(limits: RequestLimits) -> dict[str, dict[str, Any]]:
    """Component schemas of the three request bodies and the models they use."""
    out: dict[str, dict[str, Any]] = {}
    for model, patch in ((CompletionRequest, _completion), (ChatCompletionRequest, _chat)):
        schema, defs = _schema(model)
        patch(schema, limits)
        out.update(defs)
        out[model.__name__] = schema
    tgi, defs = _schema(TGIRequest)
    _tgi_parameters(defs["TGIParameters"], limits)
    tgi["properties"]["model"] = {**_nullable({"type": "string", "enum": limits.model_ids}),
                                  "description": "pdcluster's extension: which served model (absent = it)"}
    out.update(defs)
    out["TGIRequest"] = tgi
    for name, stream in (("TGIGenerateRequest", False), ("TGIStreamRequest", True)):  # stream fixed by route
        fixed = copy.deepcopy(tgi)
        fixed["properties"]["stream"] = {"type": "boolean", "enum": [stream], "default": stream,
                                         "description": "this route's answer shape (optional)"}
        out[name] = fixed
    _tokenizer_schemas(out, limits)
    if limits.ignore_unknown_fields:  # unknown fields are dropped, not refused
        for schema in out.values():
            if schema.get("additionalProperties") is False:
                del schema["additionalProperties"]
    out["CompletionRequest"]["examples"] = [{"model": limits.model_id, "prompt": "Once upon a time",
                                             "max_tokens": 8}]
    out["ChatCompletionRequest"]["examples"] = [
        {"model": limits.model_id, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}]
    for name in ("TGIRequest", "TGIGenerateRequest", "TGIStreamRequest"):
        out[name]["examples"] = [{"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}]
    return out
