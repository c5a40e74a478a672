"""Scheduler events → OpenAI completion / chat objects and stream chunks (pure; no I/O).

One `OpenAIAnswer` per request folds the events in order. While streaming, each event yields the
chunk to send now; at the end it holds the whole non-streamed object. Both carry the route of the
request in the non-standard `pdcluster_route` field of the final object.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from router.http.stops import StopTrimmer
from router.types import FinishEvent, FinishReason, PrefillEvent, Route, TokenEvent, TokenInfo

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI clients expect a finite float


# One encoder for every call: `json.dumps` with non-default options builds a new encoder each time,
# and this runs for every streamed token.
_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def openai_finish_reason(reason: FinishReason) -> str:
    """OpenAI knows only "length" and "stop"."""
    return "length" if reason is FinishReason.LENGTH else "stop"


def finite(logprob: float) -> float:
    """A logprob JSON can carry."""
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with `cached_tokens`, its `prompt_tokens_details.cached_tokens` (prompt
    tokens the prefill found in the replica's prefix cache, as vLLM and OpenAI report them)."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def route_dict(route: Route) -> dict[str, Any]:
    """The route as JSON (header `x-pdcluster-route` and field `pdcluster_route`)."""
    return {
        "prefill_replica": route.prefill_replica,
        "decode_replica": route.decode_replica,
        "strategy": route.strategy,
        "migration_bytes": route.migration_bytes,
        "migration_seconds": route.migration_seconds,
        "loading_prefill": route.loading_prefill,
        "relay_replica": route.relay_replica,
        "requeues": route.requeues,
        "cached_tokens": route.cached_tokens,
    }


def chat_logprob(token: TokenInfo) -> dict[str, Any]:
    """One entry of a chat choice's `logprobs.content`."""
    return {
        "token": token.text,
        "logprob": finite(token.logprob),
        "bytes": list(token.text.encode("utf-8")),
        "top_logprobs": [
            {"token": t.text, "logprob": finite(t.logprob), "bytes": list(t.text.encode("utf-8"))}
            for t in token.top
        ],
    }


def completion_logprobs(tokens: list[TokenInfo], first_offset: int, first_is_prompt_start: bool) -> dict:
    """A completion choice's `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
    offsets, position = [], first_offset
    for token in tokens:
        offsets.append(position)
        position += len(token.text)
    token_logprobs: list[float | None] = [finite(t.logprob) for t in tokens]
    if first_is_prompt_start and token_logprobs:
        token_logprobs[0] = None  # the first prompt token has no logprob
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": token_logprobs,
        "top_logprobs": [{x.text: finite(x.logprob) for x in t.top} or None for t in tokens],
        "text_offset": offsets,
    }


@dataclass(frozen=True)
class OpenAIContext:
    """What shapes one request's answer."""

    request_id: str
    model: str
    created: int
    chat: bool
    stops: tuple[str, ...] = ()
    logprobs: bool = False
    echo: str | None = None
    include_usage: bool = False
    fingerprint: str = "pdcluster"


@dataclass
class OpenAIAnswer:
    """Folds a request's events into OpenAI chunks and the final object."""

    ctx: OpenAIContext
    trimmer: StopTrimmer = field(init=False)
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    prompt_tokens: list[TokenInfo] = field(default_factory=list)
    prompt_has_start: bool = False
    finish: FinishEvent | None = None

    def __post_init__(self) -> None:
        self.trimmer = StopTrimmer(self.ctx.stops)
        self.text = self.ctx.echo or ""
        self._token_chunk_parts = self._prebuilt_chunk_parts()

    # ---- folding events -------------------------------------------------------------------
    def on_prefill(self, event: PrefillEvent) -> None:
        """Remember prompt tokens (echo with logprobs); special ones (BOS) are not in the echoed text."""
        self.prompt_tokens = [t for t in event.prompt_tokens if not t.special]
        self.prompt_has_start = bool(event.prompt_tokens) and not event.prompt_tokens[0].special

    def on_token(self, event: TokenEvent) -> str:
        """Fold one token; return the text now safe to show."""
        self.tokens.append(event.token)
        piece = "" if event.token.special else self.trimmer.push(event.token.text)
        self.text += piece
        return piece

    def on_finish(self, event: FinishEvent) -> str:
        """Fold the finish; return the rest of the text."""
        self.finish = event
        piece = self.trimmer.finish(event.text)
        self.text += piece
        return piece

    # ---- stream chunks --------------------------------------------------------------------
    def chunk(
        self, text: str, tokens: list[TokenInfo], finish_reason: str | None = None, role: bool = False
    ) -> dict[str, Any]:
        """One stream chunk carrying `text` (and the logprobs of `tokens` when asked)."""
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(tokens, len(self.text) - len(text))}
        if self.ctx.chat:
            choice["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = finish_reason
        body = self._envelope(chunk=True, choices=[choice])
        if self.ctx.include_usage:
            body["usage"] = None
        return body

    def token_chunk_json(self, text: str, token: TokenInfo) -> str:
        """`chunk(text, [token])` as JSON text, built from prebuilt pieces: this runs once per
        streamed token, and the router's event loop is shared with the decode loops."""
        head, text_key, tail = self._token_chunk_parts
        offset = len(self.text) - len(text)
        logprobs = self._token_logprobs_json(token, offset) if self.ctx.logprobs else "null"
        return f"{head}{logprobs}{text_key}{_json(text)}{tail}"

    def _token_logprobs_json(self, token: TokenInfo, offset: int) -> str:
        """`_json(self._logprobs([token], offset))`, written directly in the common case: a completion
        (not chat, no echo) token without alternatives (`logprobs: 0`)."""
        if self.ctx.chat or self.ctx.echo or token.top:
            return _json(self._logprobs([token], offset))
        # json writes a finite float as repr() does
        return (f'{{"tokens":[{_json(token.text)}],"token_logprobs":[{finite(token.logprob)!r}],'
                f'"top_logprobs":[null],"text_offset":[{offset}]}}')

    def _prebuilt_chunk_parts(self) -> tuple[str, str, str]:
        envelope = self._envelope(chunk=True, choices=[])
        fields = ",".join(f"{_json(k)}:{_json(v)}" for k, v in envelope.items() if k != "choices")
        head = "{" + fields + ',"choices":[{"index":0,"logprobs":'
        text_key = ',"delta":{"content":' if self.ctx.chat else ',"text":'
        tail = ("}" if self.ctx.chat else "") + ',"finish_reason":null}]'
        tail += ',"usage":null}' if self.ctx.include_usage else "}"
        return head, text_key, tail

    def final_chunk(self, text: str) -> dict[str, Any]:
        """The chunk with the finish reason and the route."""
        assert self.finish is not None
        body = self.chunk(text, [], openai_finish_reason(self.finish.reason))
        body["pdcluster_route"] = route_dict(self.finish.route)
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """The extra chunk `stream_options.include_usage` asks for: no choices, only usage."""
        body = self._envelope(chunk=True, choices=[])
        body["usage"] = self.usage()
        return body

    # ---- the whole answer -----------------------------------------------------------------
    def final_object(self) -> dict[str, Any]:
        """The non-streamed answer (call after `on_finish`)."""
        assert self.finish is not None
        choice: dict[str, Any] = {"index": 0}
        logprobs = self._logprobs(self.prompt_tokens + self.tokens if self.ctx.echo else self.tokens, 0)
        if self.ctx.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = openai_finish_reason(self.finish.reason)
        body = self._envelope(chunk=False, choices=[choice])
        body["usage"] = self.usage()
        body["pdcluster_route"] = route_dict(self.finish.route)
        return body

    def usage(self) -> dict[str, Any]:
        """Prompt, completion and cached prompt token counts (from the finish event when there is one)."""
        if self.finish is None:
            return usage(len(self.prompt_tokens), len(self.tokens))
        return usage(self.finish.prompt_tokens, self.finish.generated_tokens, self.finish.route.cached_tokens)

    def _logprobs(self, tokens: list[TokenInfo], first_offset: int) -> dict[str, Any] | None:
        if not self.ctx.logprobs:
            return None
        if self.ctx.chat:
            return {"content": [chat_logprob(t) for t in tokens]}
        # The prompt's very first token has no logprob (nothing precedes it).
        from_prompt = self.prompt_has_start and bool(self.ctx.echo) and tokens[:1] == self.prompt_tokens[:1]
        return completion_logprobs(tokens, first_offset, from_prompt)

    def _envelope(self, chunk: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = ("chat.completion" if self.ctx.chat else "text_completion") + (
            ".chunk" if chunk and self.ctx.chat else ""
        )
        return {
            "id": self.ctx.request_id,
            "object": kind,
            "created": self.ctx.created,
            "model": self.ctx.model,
            "system_fingerprint": self.ctx.fingerprint,
            "choices": choices,
        }
