"""One request's life in the router: its event stream, its generated tokens, and where it runs.

A request may run more than once ("runs"): when its replica dies, or under the `recompute`
strategy, it continues elsewhere as a *continuation* — a new prompt made of the original prompt
plus every token generated so far, with the remaining token allowance. The client sees one
unbroken stream (texts stitched across the boundary: `run_text.py`). `run` counts these; a batch
remembers the run it holds, and outputs of a stale run (a dead replica answering late) are ignored.

The route bookkeeping lives here too: where the live run is (`replica`) and what the client's
route will say, changed only through the methods under "route" below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.run_text import RunText
from router.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateRequest,
    Generation,
    PrefillEvent,
    ReplicaId,
    RequestId,
    Route,
    StoppingParams,
    TokenDecoder,
    TokenEvent,
    TokenInfo,
)

# Bytes of one token id sent by a re-prefill (only token ids move).
TOKEN_ID_BYTES = 4


@dataclass
class RouteRecord:
    """Mutable route facts gathered while the request runs (frozen into a `Route` at the end)."""

    prefill_replica: ReplicaId | None = None
    decode_replica: ReplicaId | None = None
    strategy: str = ""
    migration_bytes: int = 0
    migration_seconds: float = 0.0
    loading_prefill: bool = False
    relay_replica: ReplicaId | None = None
    cached_tokens: int = 0

    def freeze(self, requeues: int = 0) -> Route:
        """The client-facing route (`requeues`: the request's re-runs after replica failures)."""
        return Route(**dataclasses.asdict(self), requeues=requeues)


class RequestState:
    """Everything the router knows about one accepted request."""

    def __init__(self, request_id: RequestId, request: GenerateRequest, clock: Callable[[], float],
                 decoder: TokenDecoder) -> None:
        self.id = request_id
        self.original = request
        self.clock = clock
        self.submitted_at = clock()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.generated: list[int] = []
        self.texts: list[str] = []
        self.text = RunText(decoder, request.input_ids)
        self.run = 0
        self.requeues = 0
        self.refusals = 0  # times a replica refused its batch for want of pages
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
            stopping=StoppingParams(
                remaining,
                stopping.stop_sequences,
                stopping.ignore_eos,
                max(0, stopping.min_new_tokens - len(self.generated)),
            ),
            prefill_logprobs=False,
            truncate=None,
            # the replica counts these as generated: penalties, seeded sampling's step index and
            # stop sequences continue exactly where the earlier run stopped
            generated_prefix=len(self.generated),
        )

    def new_run(self) -> int:
        """Start a continuation (the previous run's outputs become stale); returns the new run."""
        self.run += 1
        self.text.boundary(self.generated, self.texts)
        self.replica = None
        return self.run

    # ---- route ---------------------------------------------------------------------------------

    def batched(self, strategy: str) -> None:
        """Cut into a batch that goes by `strategy`."""
        self.route.strategy = strategy

    def prefilling(self, replica: ReplicaId, from_queue: bool = True) -> None:
        """Its live run is prefilled on `replica` (a prefill replica when it came from the queue)."""
        self.replica = replica
        if from_queue:
            self.route.prefill_replica = replica

    def zigzag(self, replica: ReplicaId) -> None:
        """Its live run is prefilled layer by layer on `replica`, which is still receiving weights."""
        self.prefilling(replica)
        self.route.loading_prefill = True

    def relayed(self, replica: ReplicaId) -> None:
        """The loaded `replica` took its layer-by-layer prefill over and finishes it."""
        self.replica = replica
        self.route.relay_replica = replica

    def decoding(self, replica: ReplicaId, strategy: str = "") -> None:
        """Its live run decodes on `replica` (by `strategy`, when that decides the route's name)."""
        self.replica = replica
        self.route.decode_replica = replica
        if strategy:
            self.route.strategy = strategy

    def migrated(self, replica: ReplicaId, strategy: str, nbytes: int, seconds: float) -> None:
        """Its KV moved to `replica` (`nbytes` of it, in the batch's `seconds`)."""
        self.decoding(replica, strategy)
        self.route.migration_bytes += nbytes
        self.route.migration_seconds += seconds

    def resent(self, strategy: str) -> None:
        """Its tokens (not its KV) go to another replica, which prefills them again: a new run."""
        self.new_run()
        self.route.strategy = strategy
        self.route.migration_bytes += TOKEN_ID_BYTES * len(self.current().input_ids)

    def sent_to(self, replica: ReplicaId, seconds: float = 0.0) -> None:
        """Its re-sent run is bound for `replica` (and took `seconds` to get there)."""
        self.replica = replica
        self.route.migration_seconds += seconds

    def deliver(self, gen: Generation) -> bool:
        """Turn one step's output into events; returns True when the request finished."""
        if self.done:
            return True
        if not self.prefill_sent:
            self.prefill_sent = True
            self.events.put_nowait(PrefillEvent(gen.prefill_tokens))
            # the prefill that answered the client: its prompt tokens taken from the prefix cache
            self.route.cached_tokens = min(gen.cached_tokens, len(self.original.input_ids))
        for token in gen.tokens:
            if self.first_token_at is None:
                self.first_token_at = self.clock()
            self.generated.append(token.id)
            if self.text.held_from is not None:
                token = self._stitched(token)
            self.texts.append(token.text)
            self.events.put_nowait(TokenEvent(token, len(self.generated) - 1))
        if gen.finished is None:
            return False
        self.done = True
        self.finished_at = self.clock()
        # a continuation's replica decoded only its own run: the whole text comes from all the ids
        text = self.text.final(self.generated) if self.run else gen.finished.text
        self.events.put_nowait(FinishEvent(
            text=text, reason=gen.finished.reason,
            generated_tokens=len(self.generated), prompt_tokens=len(self.original.input_ids),
            seed=self._reported_seed(gen.finished.seed), route=self.route.freeze(self.requeues),
        ))
        return True

    def _stitched(self, token: TokenInfo) -> TokenInfo:
        """The token with its text re-decoded across the run boundary (text held back before it)."""
        text = self.text.text(self.generated, token.text)
        return token if text == token.text else dataclasses.replace(token, text=text)

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
