"""The OpenAPI document: every route's body, answers, errors and content types are described."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from router.http.info import ServingInfo
from router.http.openapi import build_openapi
from router.http.request_schema import below_regex

INFO = ServingInfo(model_id="m", max_input_tokens=16, max_total_tokens=40)


@pytest.fixture(params=[False, True], ids=["open", "keys"])
def doc(request: pytest.FixtureRequest) -> dict[str, Any]:
    return build_openapi("pdcluster router", INFO, 200, keys=request.param)


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, item in doc["paths"].items() for method, op in item.items()]


def test_every_post_has_a_required_json_body_and_every_answer_a_body(doc: dict[str, Any]) -> None:
    for path, method, op in operations(doc):
        if method == "post":
            body = op["requestBody"]
            assert body["required"] and "$ref" in body["content"]["application/json"]["schema"], path
            generates = path not in ("/tokenize", "/detokenize")  # the tokenizer's routes queue nothing
            due = {"400", "500", "502", "503"} if generates else {"400"}
            assert due <= set(op["responses"]), path
        for status, answer in op["responses"].items():
            assert answer["content"], (path, status)


def test_auth_documented_only_with_keys(doc: dict[str, Any]) -> None:
    keys = "securitySchemes" in doc["components"]
    for path, _, op in operations(doc):
        guarded = path.startswith("/v1/") or path in ("/generate", "/generate_stream", "/")
        assert ("security" in op) == (keys and guarded), path
        assert ("401" in op["responses"]) == (keys and guarded), path
        if keys and guarded:
            assert op["responses"]["429"]["headers"]["Retry-After"]["required"] is True


def test_content_types(doc: dict[str, Any]) -> None:
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    for path in ("/v1/completions", "/v1/chat/completions", "/"):
        assert set(doc["paths"][path]["post"]["responses"]["200"]["content"]) == {
            "application/json", "text/event-stream"}
    stream = doc["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert set(stream) == {"text/event-stream"}


def test_no_pydantic_keyword_leaks_into_the_schema(doc: dict[str, Any]) -> None:
    """pydantic writes bounds given after a validator as `gt`/`ge`, which JSON Schema ignores: the
    bounds vanished from the document (found by Schemathesis: `truncate: 0` generated as valid)."""
    text = json.dumps(doc)
    assert not re.search(r'"(gt|ge|lt|le)":', text)
    params = doc["components"]["schemas"]["TGIParameters"]["properties"]
    assert params["truncate"]["anyOf"][0]["minimum"] == 1


def test_served_limits_are_in_the_request_schemas(doc: dict[str, Any]) -> None:
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == 39
    assert completion["model"]["anyOf"][0]["enum"] == ["m"]
    ids = completion["prompt"]["anyOf"][1]
    assert ids["maxItems"] == 16 and ids["items"]["maximum"] == 199


@pytest.mark.parametrize("limit", [1, 2, 9, 10, 11, 99, 100, 101, 200, 4096, 32000, 151936])
def test_below_regex_is_exactly_the_ids_below(limit: int) -> None:
    pattern = re.compile(below_regex(limit))
    for n in [*range(0, min(limit * 2 + 5, 3000)), limit - 1, limit, limit + 1, limit * 10]:
        assert bool(pattern.match(str(n))) == (n < limit), n
    assert pattern.match(f"00{limit - 1}") and not pattern.match("-1") and not pattern.match("")


def test_model_names_every_served_model_and_an_unknown_one_is_a_documented_404() -> None:
    doc = build_openapi("pdcluster router", INFO, 200, keys=False, more_model_ids=("other",))
    schemas = doc["components"]["schemas"]
    for body in ("CompletionRequest", "ChatCompletionRequest", "TGIRequest", "TGIGenerateRequest",
                 "TGIStreamRequest"):
        assert schemas[body]["properties"]["model"]["anyOf"][0]["enum"] == ["m", "other"], body
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream", "/"):
        assert "404" in doc["paths"][path]["post"]["responses"], path
