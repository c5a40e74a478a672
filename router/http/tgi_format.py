"""Scheduler events → TGI's `/generate` and `/generate_stream` shapes and timing headers (pure)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from router.http.openai_format import finite, route_dict
from router.types import FinishEvent, TokenEvent, TokenInfo, TopToken


def tgi_token(token: TokenInfo | TopToken) -> dict[str, Any]:
    """TGI's Token object."""
    return {"id": token.id, "text": token.text, "logprob": finite(token.logprob), "special": token.special}


def tgi_prefill(tokens: tuple[TokenInfo, ...]) -> list[dict[str, Any]]:
    """TGI's `prefill` list (InputToken); the first prompt token has no logprob."""
    return [
        {"id": t.id, "text": t.text, "logprob": None if i == 0 else finite(t.logprob)}
        for i, t in enumerate(tokens)
    ]


@dataclass(frozen=True)
class TGIContext:
    """What shapes one TGI answer."""

    details: bool
    decoder_input_details: bool
    top_n_tokens: int
    prefix: str  # the input text when return_full_text, else ""
    input_length: int


def generate_object(
    ctx: TGIContext, finish: FinishEvent, tokens: list[TokenInfo], prompt_tokens: tuple[TokenInfo, ...]
) -> dict[str, Any]:
    """The body of a non-streamed `/generate` answer."""
    body: dict[str, Any] = {"generated_text": ctx.prefix + finish.text}
    if ctx.details:
        details: dict[str, Any] = {
            "finish_reason": finish.reason.value,
            "generated_tokens": finish.generated_tokens,
            "seed": finish.seed,
            "prefill": tgi_prefill(prompt_tokens) if ctx.decoder_input_details else [],
            "tokens": [tgi_token(t) for t in tokens],
            "best_of_sequences": None,
        }
        if ctx.top_n_tokens:
            details["top_tokens"] = [[tgi_token(x) for x in t.top] for t in tokens]
        body["details"] = details
    body["pdcluster_route"] = route_dict(finish.route)
    return body


def stream_object(ctx: TGIContext, event: TokenEvent, finish: FinishEvent | None = None) -> dict[str, Any]:
    """One `/generate_stream` event; the last one carries the text, details and route."""
    body: dict[str, Any] = {
        "index": event.index,
        "token": tgi_token(event.token),
        "top_tokens": [tgi_token(x) for x in event.token.top] if ctx.top_n_tokens else None,
        "generated_text": None,
        "details": None,
    }
    if finish is not None:
        body["generated_text"] = ctx.prefix + finish.text
        body["details"] = {
            "finish_reason": finish.reason.value,
            "generated_tokens": finish.generated_tokens,
            "seed": finish.seed,
            "input_length": ctx.input_length,
        }
        body["pdcluster_route"] = route_dict(finish.route)
    return body


def _ms(seconds: float) -> str:
    return str(round(seconds * 1000.0))


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


@dataclass
class Timeline:
    """When a request was received, validated, and got each token: TGI's timing headers.

    `x-queue-time` and `x-compute-time` are not reported separately: the scheduler does not say
    when a request left the queue, so the time to the first token counts both.
    """

    received: float = field(default_factory=time.monotonic)
    validated: float | None = None
    token_times: list[float] = field(default_factory=list)

    def mark_validated(self) -> None:
        """Validation and tokenization are done."""
        self.validated = time.monotonic()

    def mark_token(self) -> None:
        """A token arrived now."""
        self.token_times.append(time.monotonic())

    def headers(
        self, request_id: str, input_length: int, output_length: int, characters: int
    ) -> dict[str, str]:
        """The x-* headers TGI's non-streamed `/generate` sends (those that can be computed here)."""
        end = time.monotonic()
        validated = self.validated or self.received
        times = self.token_times
        gaps = [b - a for a, b in itertools.pairwise(times)]
        inference = end - validated
        headers = {
            "x-request-id": request_id,
            "x-compute-type": "pdcluster",
            "x-compute-characters": str(characters),
            "x-total-time": _ms(end - self.received),
            "x-validation-time": _ms(validated - self.received),
            "x-inference-time": _ms(inference),
            "x-time-per-token": _ms(inference / max(output_length, 1)),
            "x-input-length": str(input_length),
            "x-output-length": str(output_length),
        }
        if times:
            headers["x-first-token-time"] = _ms(times[0] - self.received)
        headers.update(self._gap_headers(gaps))
        return headers

    @staticmethod
    def _gap_headers(gaps: list[float]) -> dict[str, str]:
        if not gaps:
            return {}
        ordered = sorted(gaps)
        return {
            "x-first-decode-token-time": _ms(gaps[0]),
            "x-max-time-between-tokens": _ms(ordered[-1]),
            "x-max-time-between-tokens-except-first": _ms(max(gaps[1:], default=0.0)),
            "x-avg-time-between-tokens": _ms(sum(gaps) / len(gaps)),
            "x-p90-time-between-tokens": _ms(_percentile(ordered, 0.90)),
            "x-p95-time-between-tokens": _ms(_percentile(ordered, 0.95)),
            "x-p99-time-between-tokens": _ms(_percentile(ordered, 0.99)),
        }
