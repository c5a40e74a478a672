"""Schemathesis hooks for the router's schema: schema-valid requests are accepted unless their
token counts are over the served limits, and then they are refused 400 (both directions checked).

Replaces Schemathesis' own `positive_data_acceptance`, which expects every schema-valid request to
pass: a JSON schema cannot count a text prompt's tokens, so the router's schema documents those
limits as a 400 instead (router/http/request_schema.py). This oracle tokenizes each generated body
with the served checkpoint's tokenizer and reads the limits from /info:

    PDCLUSTER_ST_MODEL_DIR=DIR PDCLUSTER_ST_URL=http://HOST:PORT \\
    SCHEMATHESIS_HOOKS=tests.helpers.schemathesis_hooks schemathesis run ... \\
        --exclude-checks positive_data_acceptance
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import httpx
import schemathesis

from router.http.errors import APIError
from router.http.schemas import ChatCompletionRequest, CompletionRequest, TGIRequest
from router.http.structured import openai_grammar, tgi_grammar
from router.http.tools import plan_tools, template_messages
from router.tokenizer import ChatTemplateError, Tokenizer


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(Path(os.environ["PDCLUSTER_ST_MODEL_DIR"]))


@functools.cache
def _limits() -> tuple[int, int]:
    info = httpx.get(f"{os.environ['PDCLUSTER_ST_URL']}/info", timeout=30).json()
    return int(info["max_input_tokens"]), int(info["max_total_tokens"])


def _completion_ids(prompt: Any) -> list[int]:
    tok = _tokenizer()
    if isinstance(prompt, str):
        return tok.encode(prompt)
    first = prompt[0]
    if isinstance(first, int | float):  # JSON Schema's integers include 5.0
        return [int(t) for t in prompt]
    return tok.encode(first) if isinstance(first, str) else [int(t) for t in first]


def _chat_ids(body: dict[str, Any]) -> list[int] | None:
    tok = _tokenizer()
    try:  # the router's own rendering: earlier tool calls and the tools are part of the prompt
        parsed = ChatCompletionRequest.model_validate(body)
    except ValueError:
        return None
    tools = [t.model_dump(exclude_none=True) for t in parsed.tools] if parsed.tools else None
    try:
        messages = template_messages(parsed.messages)
        prompt = tok.apply_chat_template(messages, parsed.add_generation_prompt, tools)
    except ChatTemplateError:
        return None
    return tok.encode(prompt, add_special_tokens=False)


def _ids_and_new(path: str, body: dict[str, Any]) -> tuple[list[int] | None, int | None]:
    if path == "/v1/completions":
        return _completion_ids(body["prompt"]), body.get("max_tokens")
    if path == "/v1/chat/completions":
        asked = body.get("max_completion_tokens")
        return _chat_ids(body), asked if asked is not None else body.get("max_tokens")
    params = body.get("parameters") or {}
    ids = _tokenizer().encode(body["inputs"])
    if params.get("truncate") is not None:
        ids = ids[-int(params["truncate"]) :]
    return ids, params.get("max_new_tokens")


def over_token_limits(path: str, body: dict[str, Any]) -> bool:
    """Whether the router must refuse this schema-valid body for its token counts."""
    ids, new = _ids_and_new(path, body)
    max_input, max_total = _limits()
    if ids is None or not ids or len(ids) > max_input:
        return True
    least = int(body.get("min_tokens") or 0)  # OpenAI routes: at most the maximum of new tokens
    if least > (int(new) if new is not None else max_total - len(ids)):
        return True
    return len(ids) + (int(new) if new is not None else 1) > max_total


_GENERATION = {"/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream", "/"}


def grammar_refused(path: str, body: dict[str, Any]) -> bool:
    """Whether the router must refuse this schema-valid body for its grammar or tools: a JSON Schema
    or regex the grammar engine does not compile, a json_schema format without a schema, tool_choice
    without tools or naming a function not in them, tools for a chat template that does not render
    them (what no OpenAPI schema can say)."""
    try:
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(body)
            if plan_tools(chat.tools, chat.tool_choice, chat.response_format).tools:
                return not _tokenizer().supports_tools  # a template that cannot render them
            openai_grammar(chat.response_format)
        elif path == "/v1/completions":
            openai_grammar(CompletionRequest.model_validate(body).response_format)
        elif path in ("/generate", "/generate_stream", "/"):
            tgi_grammar(TGIRequest.model_validate(body).parameters.grammar)
    except APIError:
        return True
    except ValueError:  # not the route's body: its own checks answer
        return False
    return False


@schemathesis.check
def accepted_unless_over_token_limits(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """A schema-valid request gets 2xx, or 400 exactly when its tokens are over the limits."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    status = response.status_code
    body = case.body if isinstance(case.body, dict) else None
    refuse = case.path in _GENERATION and body is not None and (
        over_token_limits(case.path, body) or grammar_refused(case.path, body)
    )
    if refuse and status != 400:
        raise AssertionError(f"over the token limits, so 400 was due; got {status}")
    if not refuse and not 200 <= status < 300:
        raise AssertionError(
            f"schema-valid and within the token limits, so 2xx was due; got {status} "
            f"({meta.phase.name.value} phase, {meta.phase.data!r}, components {meta.components!r})"
        )
    return None
