"""A fake `Scheduler` for front-end tests: a deterministic token stream that records closes.

Each request produces tokens `" w<k>"` (ids from `WORDS`) derived from its prompt, honours
`max_new_tokens`, stop sequences and `ignore_eos`, and can be told to reject, fail midway or go
slowly. `closed` lists the requests whose iterator was explicitly closed before their `FinishEvent`: what a
real scheduler must treat as "client gone, drop it and free its pages".
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from router.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    PrefillEvent,
    ReplicaId,
    RequestRejected,
    Route,
    TokenEvent,
    TokenInfo,
    TopToken,
)

WORDS = tuple(f"w{i}" for i in range(40))
EOS_ID = 2
ROUTE = Route(
    prefill_replica=ReplicaId(0),
    decode_replica=ReplicaId(1),
    strategy="full",
    migration_bytes=4096,
    migration_seconds=0.002,
)


def fake_token(request: GenerateRequest, index: int) -> TokenInfo:
    """The `index`-th generated token of `request` (deterministic in its prompt)."""
    word = (sum(request.input_ids) + index) % len(WORDS)
    top = tuple(
        TopToken(id=100 + (word + k) % len(WORDS), text=f" w{(word + k) % len(WORDS)}", logprob=-0.5 - k)
        for k in range(request.top_n_tokens)
    )
    return TokenInfo(id=100 + word, text=f" {WORDS[word]}", logprob=-0.5, top=top)


def expected_text(request: GenerateRequest, count: int) -> str:
    """The text of the first `count` tokens the fake generates for `request`."""
    return "".join(fake_token(request, i).text for i in range(count))


@dataclass
class FakeScheduler:
    """Deterministic scheduler double; records every request and every early close."""

    healthy: bool = True
    token_delay: float = 0.0
    reject: RequestRejected | None = None
    reject_on_first_event: RequestRejected | None = None
    fail_after: int | None = None
    eos_after: int | None = None
    submitted: list[GenerateRequest] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    closed_event: threading.Event = field(default_factory=threading.Event)

    def submit(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Record and stream `request`, or raise the configured rejection."""
        if self.reject is not None:
            raise self.reject
        self.submitted.append(request)
        return FakeStream(self, len(self.submitted) - 1, self._events(request))

    def is_healthy(self) -> bool:
        """As configured."""
        return self.healthy

    def _events(self, request: GenerateRequest) -> Iterator[Event]:
        if self.fail_after == 0:  # the prefill itself failed: no PrefillEvent
            yield ErrorEvent(message="replica 0 failed the prefill: boom", http_status=500)
            return
        prompt = tuple(
            TokenInfo(id=t, text=f"p{t}", logprob=-1.0) for t in request.input_ids if request.prefill_logprobs
        )
        yield PrefillEvent(prompt_tokens=prompt)
        text = ""
        limit = request.stopping.max_new_tokens
        for i in range(limit):
            if self.fail_after is not None and i == self.fail_after:
                yield ErrorEvent(message="replica 1 failed the batch: boom", http_status=500)
                return
            early = i < request.stopping.min_new_tokens  # no EOS, no stop sequence yet (min_tokens)
            if (
                self.eos_after is not None
                and i == self.eos_after
                and not request.stopping.ignore_eos
                and not early
            ):
                yield TokenEvent(TokenInfo(id=EOS_ID, text="", logprob=-0.1, special=True), i)
                yield self._finish(request, text, FinishReason.EOS_TOKEN, i + 1)
                return
            token = fake_token(request, i)
            text += token.text
            yield TokenEvent(token, i)
            if i + 1 >= request.stopping.min_new_tokens and any(
                stop in text for stop in request.stopping.stop_sequences
            ):
                yield self._finish(request, text, FinishReason.STOP_SEQUENCE, i + 1)
                return
        yield self._finish(request, text, FinishReason.LENGTH, limit)

    @staticmethod
    def _finish(request: GenerateRequest, text: str, reason: FinishReason, count: int) -> FinishEvent:
        return FinishEvent(
            text=text,
            reason=reason,
            generated_tokens=count,
            prompt_tokens=len(request.input_ids),
            seed=request.sampling.seed,
            route=ROUTE,
        )


class FakeStream:
    """One request's events. Only an explicit `aclose()` counts as "client gone": a cancelled
    `__anext__` leaves the stream open, so tests see whether the front end really closes it."""

    def __init__(self, owner: FakeScheduler, index: int, events: Iterator[Event]) -> None:
        self._owner = owner
        self._index = index
        self._events = events
        self._done = False
        self._closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Event:
        if self._closed or self._done:
            raise StopAsyncIteration
        if self._owner.reject_on_first_event is not None:
            raise self._owner.reject_on_first_event
        event = next(self._events)
        if isinstance(event, TokenEvent) and self._owner.token_delay:
            await asyncio.sleep(self._owner.token_delay)
        if isinstance(event, FinishEvent | ErrorEvent):
            self._done = True
            self._owner.finished.append(self._index)
        return event

    async def aclose(self) -> None:
        """The consumer is done; before the finish this means the client went away."""
        if self._closed:
            return
        self._closed = True
        if not self._done:
            self._owner.closed.append(self._index)
            self._owner.closed_event.set()
