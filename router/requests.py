"""One request's life in the router: its event stream, its generated tokens, and where it runs.

A request may run more than once ("runs"): when its replica dies, or under the `recompute`
strategy, it continues elsewhere as a *continuation* — a new prompt made of the original prompt
plus every token generated so far, with the remaining token allowance. The client sees one
unbroken stream. `run` counts these; a batch remembers the run it holds, and outputs of a stale
run (a dead replica answering late) are ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.client import Generation
from router.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateRequest,
    PrefillEvent,
    ReplicaId,
    RequestId,
    Route,
    StoppingParams,
    TokenEvent,
)


@dataclass
class RouteRecord:
    """Mutable route facts gathered while the request runs (frozen into a `Route` at the end)."""

    prefill_replica: ReplicaId | None = None
    decode_replica: ReplicaId | None = None
    strategy: str = ""
    migration_bytes: int = 0
    migration_seconds: float = 0.0

    def freeze(self, requeues: int = 0) -> Route:
        """The client-facing route (`requeues`: the request's re-runs after replica failures)."""
        return Route(**dataclasses.asdict(self), requeues=requeues)


class RequestState:
    """Everything the router knows about one accepted request."""

    def __init__(self, request_id: RequestId, request: GenerateRequest, clock: Callable[[], float]) -> None:
        self.id = request_id
        self.original = request
        self.clock = clock
        self.submitted_at = clock()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.generated: list[int] = []
        self.texts: list[str] = []
        self.text_before_run = ""
        self.run = 0
        self.requeues = 0
        self.replica: ReplicaId | None = None
        self.cancelled = False
        self.done = False
        self.prefill_sent = False
        self.route = RouteRecord()

    @property
    def alive(self) -> bool:
        """Still wanted and not finished: worth computing."""
        return not (self.cancelled or self.done)

    def current(self) -> GenerateRequest:
        """The request to run now: the original, or a continuation after `len(generated)` tokens."""
        if not self.generated:
            return self.original
        stopping = self.original.stopping
        remaining = stopping.max_new_tokens - len(self.generated)
        return dataclasses.replace(
            self.original,
            input_ids=self.original.input_ids + tuple(self.generated),
            stopping=StoppingParams(remaining, stopping.stop_sequences, stopping.ignore_eos),
            prefill_logprobs=False,
            truncate=None,
            # the replica counts these as generated: penalties, seeded sampling's step index and
            # stop sequences continue exactly where the earlier run stopped
            generated_prefix=len(self.generated),
        )

    def new_run(self) -> int:
        """Start a continuation (the previous run's outputs become stale); returns the new run."""
        self.run += 1
        self.text_before_run = "".join(self.texts)
        self.replica = None
        return self.run

    def deliver(self, gen: Generation) -> bool:
        """Turn one step's output into events; returns True when the request finished."""
        if self.done:
            return True
        if not self.prefill_sent:
            self.prefill_sent = True
            self.events.put_nowait(PrefillEvent(gen.prefill_tokens))
        for token in gen.tokens:
            if self.first_token_at is None:
                self.first_token_at = self.clock()
            self.generated.append(token.id)
            self.texts.append(token.text)
            self.events.put_nowait(TokenEvent(token, len(self.generated) - 1))
        if gen.finished is None:
            return False
        self.done = True
        self.finished_at = self.clock()
        self.events.put_nowait(FinishEvent(
            text=self.text_before_run + gen.finished.text, reason=gen.finished.reason,
            generated_tokens=len(self.generated), prompt_tokens=len(self.original.input_ids),
            seed=self._reported_seed(gen.finished.seed), route=self.route.freeze(self.requeues),
        ))
        return True

    def _reported_seed(self, replica_seed: int | None) -> int | None:
        """The client's seed. A continuation carries it unchanged; one of an unseeded request drew a
        seed of its replica's own, which would not reproduce the whole answer: 0 then."""
        if self.run == 0 or replica_seed is None:
            return replica_seed
        return self.original.sampling.seed or 0

    def fail(self, message: str, http_status: int = 500) -> None:
        """End the request with an error event (no-op when it already ended)."""
        if self.done:
            return
        self.done = True
        self.finished_at = self.clock()
        self.events.put_nowait(ErrorEvent(message, http_status))



class RequestStream:
    """The async iterator `Scheduler.submit` returns; closing it early cancels the request."""

    def __init__(self, state: RequestState, on_close: Callable[[RequestState], None]) -> None:
        self._state = state
        self._on_close = on_close
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._closed:
            raise StopAsyncIteration
        try:
            event = await self._state.events.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if isinstance(event, FinishEvent | ErrorEvent):
            self._closed = True
        return event

    async def aclose(self) -> None:
        """The consumer went away: drop the request and free its pages (once)."""
        if self._closed:
            return
        self._closed = True
        if not self._state.done:
            self._state.cancelled = True
            self._on_close(self._state)

    def __del__(self) -> None:
        # A stream dropped without being closed (e.g. a handler that crashed) still cancels.
        if not self._closed and not self._state.done:
            self._state.cancelled = True


def now() -> float:
    """The default clock (monotonic seconds)."""
    return time.monotonic()
