"""The seam between the router's front end (HTTP) and its scheduler: plain frozen dataclasses.

The front end validates and tokenizes a user request into a `GenerateRequest`, hands it to a
`Scheduler`, and turns the events it yields into OpenAI / TGI responses. The scheduler owns all
queueing, batching, replica and migration state. Nothing here imports grpc, HTTP or torch.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NewType, Protocol

RequestId = NewType("RequestId", int)
ReplicaId = NewType("ReplicaId", int)


class FinishReason(enum.Enum):
    """Why a request stopped generating (TGI's names; OpenAI maps LENGTH → "length", others → "stop")."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; defaults are greedy and no penalties."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


@dataclass(frozen=True)
class StoppingParams:
    """When generation stops."""

    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerateRequest:
    """One validated, tokenized user request."""

    input_ids: tuple[int, ...]
    sampling: SamplingParams
    stopping: StoppingParams
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    truncate: int | None = None


@dataclass(frozen=True)
class TopToken:
    """One alternative of a generated token."""

    id: int
    text: str
    logprob: float
    special: bool = False


@dataclass(frozen=True)
class TokenInfo:
    """One generated (or prompt) token."""

    id: int
    text: str
    logprob: float
    special: bool = False
    top: tuple[TopToken, ...] = ()


@dataclass(frozen=True)
class Route:
    """Where a request ran: reported to the client (demo) and in metrics."""

    prefill_replica: ReplicaId | None = None
    decode_replica: ReplicaId | None = None
    strategy: str = ""
    migration_bytes: int = 0
    migration_seconds: float = 0.0


@dataclass(frozen=True)
class PrefillEvent:
    """The prompt was prefilled; carries prompt tokens when prefill logprobs were asked."""

    prompt_tokens: tuple[TokenInfo, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One new token; `index` counts generated tokens from 0."""

    token: TokenInfo
    index: int


@dataclass(frozen=True)
class FinishEvent:
    """The request finished; always the last event of a successful request."""

    text: str
    reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    seed: int | None = None
    route: Route = field(default_factory=Route)


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed after it was accepted (a replica error); the last event."""

    message: str
    http_status: int = 500


Event = PrefillEvent | TokenEvent | FinishEvent | ErrorEvent


class RequestRejected(Exception):
    """Raised by `Scheduler.submit` before queueing: the request cannot be served as given."""

    def __init__(self, message: str, http_status: int = 400) -> None:
        super().__init__(message)
        self.http_status = http_status


class Scheduler(Protocol):
    """What the front end needs from the scheduling core."""

    def submit(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Queue a request and stream its events.

        Raises `RequestRejected` (before anything is queued) for a request over the limits.
        Closing the iterator early (`aclose()`, or the consumer task being cancelled) means the
        client went away: the request is dropped and its pages freed.
        """
        ...

    def is_healthy(self) -> bool:
        """True when at least one replica can serve."""
        ...
