"""Tokenizer routes: POST /tokenize (vLLM's and TGI's shapes on one path) and POST /detokenize (vLLM).

`/tokenize` tells the shapes apart by the body: `inputs` is TGI's request (an answer of tokens with
their text and character offsets), `messages` vLLM's chat request (rendered by the chat template
as /v1/chat/completions renders it), `prompt` vLLM's completion request. Nothing reaches the
scheduler; every refusal is a 400 in the shape's own error flavour naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from router.http.common import backend_of, model_backend
from router.http.errors import APIError, Flavor
from router.http.responses import json_response
from router.http.schemas import (
    DetokenizeRequest,
    TGITokenizeParameters,
    TGITokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from router.http.tools import template_messages
from router.http.validation import parse_body
from router.tokenizer import ChatTemplateError

router = APIRouter()


def _shape(raw: bytes) -> str:
    """ "tgi", "chat" or "completion": which request `raw` is (parse_body reports malformed JSON)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return "completion"
    if isinstance(data, dict) and "inputs" in data:
        return "tgi"
    return "chat" if isinstance(data, dict) and "messages" in data else "completion"


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """Token ids of a prompt or of chat messages (vLLM), or tokens with offsets (TGI)."""
    backend = backend_of(request)
    raw = await request.body()
    ignore = backend.info.ignore_unknown_fields
    shape = _shape(raw)
    if shape == "tgi":
        return json_response(_tgi_tokens(request, parse_body(raw, TGITokenizeRequest, Flavor.TGI, ignore)))
    body: TokenizeChatRequest | TokenizeCompletionRequest
    if shape == "chat":
        body = parse_body(raw, TokenizeChatRequest, Flavor.OPENAI, ignore)
        backend = model_backend(request, body.model)
        tokenizer = backend.tokenizer
        try:
            text = tokenizer.apply_chat_template(template_messages(body.messages), body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise APIError(str(exc), 400, param="messages") from exc
    else:
        body = parse_body(raw, TokenizeCompletionRequest, Flavor.OPENAI, ignore)
        backend = model_backend(request, body.model)
        tokenizer = backend.tokenizer
        text = body.prompt
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    answer: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": backend.info.max_total_tokens,
        "tokens": ids,
        "token_strs": [tokenizer.token_piece(i) for i in ids] if body.return_token_strs else None,
    }
    return json_response(answer)


def _tgi_tokens(request: Request, body: TGITokenizeRequest) -> list[dict[str, Any]]:
    """TGI's answer: `[{id, text, start, stop}]`; `parameters.truncate` keeps the last tokens (the
    generation parameters do not apply: unknown fields here, refused)."""
    params = body.parameters or TGITokenizeParameters()
    tokens = backend_of(request).tokenizer.encode_with_offsets(body.inputs)
    if params.truncate is not None:
        tokens = tokens[-params.truncate :]
    return [{"id": i, "text": body.inputs[a:b], "start": a, "stop": b} for i, a, b in tokens]


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """The text of token ids (vLLM): special tokens kept, as transformers' `decode` does."""
    backend = backend_of(request)
    body = parse_body(
        await request.body(), DetokenizeRequest, Flavor.OPENAI, backend.info.ignore_unknown_fields
    )
    backend = model_backend(request, body.model)
    vocab, most = backend.tokenizer.vocab_size, backend.info.max_total_tokens
    if len(body.tokens) > most:
        raise APIError(f"at most {most} token ids (max_model_len)", 400, param="tokens")
    if any(t >= vocab for t in body.tokens):
        raise APIError(f"token ids must be in [0, {vocab})", 400, param="tokens")
    return json_response({"prompt": backend.tokenizer.decode(body.tokens, skip_special_tokens=False)})
