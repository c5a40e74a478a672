"""Per-key limits over a rolling minute: requests, requests in flight, tokens (pure; injectable clock).

    admit(key) ──► Lease (rpm counted, one concurrency slot held) | Refusal(kind, retry_after)
    lease.charge(prompt, max_new) ──► tokens reserved in the key's minute | Refusal
    lease.observe(event) …            generated tokens counted as they stream
    lease.release() ──► slot freed; the reservation becomes prompt + tokens generated

Tokens per minute count prompt + completion tokens. At admission a request reserves its prompt
tokens plus its `max_new_tokens` (the most it can use, as OpenAI estimates); when it ends (finished,
failed or abandoned) the reservation is lowered to what it really used. Tokens are charged to the
minute the request was admitted in. A request whose reservation alone is over its key's `tpm` can
never run: `TooLarge` (answered 400, not 429, since waiting does not help).
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.http.keys import ApiKey, KeyTable
from router.types import Event, FinishEvent, TokenEvent

WINDOW_S = 60.0


class LimitKind(enum.Enum):
    """Which limit refused a request (the `reason` label of the rejection metric)."""

    RPM = "rpm"
    CONCURRENT = "concurrent"
    TPM = "tpm"


@dataclass(frozen=True)
class Refusal:
    """Over a limit now; `retry_after` whole seconds until it may pass (an upper bound for tpm)."""

    kind: LimitKind
    retry_after: int
    message: str


@dataclass(frozen=True)
class TooLarge:
    """The request alone needs more tokens than its key may use in a minute."""

    needed: int
    limit: int


@dataclass
class _Charge:
    at: float
    tokens: int


@dataclass
class _Usage:
    """One key's minute: admission times, in-flight count, token charges (oldest first)."""

    admitted: deque[float] = field(default_factory=deque)
    in_flight: int = 0
    charges: deque[_Charge] = field(default_factory=deque)

    def forget_before(self, cutoff: float) -> None:
        while self.admitted and self.admitted[0] <= cutoff:
            self.admitted.popleft()
        while self.charges and self.charges[0].at <= cutoff:
            self.charges.popleft()

    def tokens(self) -> int:
        return sum(c.tokens for c in self.charges)


def _seconds(span: float) -> int:
    return max(1, math.ceil(span))


class Lease:
    """One admitted request: holds a concurrency slot until `release()` (idempotent)."""

    def __init__(self, limiter: RateLimiter, key: ApiKey) -> None:
        self.key = key
        self._limiter = limiter
        self._charge: _Charge | None = None
        self._prompt = 0
        self.generated = 0
        self.released = False

    def charge(self, prompt_tokens: int, max_new_tokens: int) -> Refusal | TooLarge | None:
        """Reserve the request's tokens (None = admitted) under its key's `tpm`."""
        self._prompt = prompt_tokens
        result = self._limiter.reserve(self.key, prompt_tokens + max_new_tokens)
        if isinstance(result, _Charge):
            self._charge = result
            return None
        return result

    def observe(self, event: Event) -> None:
        """Count generated tokens as they arrive (the finish says the exact number)."""
        if isinstance(event, TokenEvent):
            self.generated = max(self.generated, event.index + 1)
        elif isinstance(event, FinishEvent):
            self.generated = event.generated_tokens

    def refund(self) -> None:
        """The request never reached the scheduler: it uses no tokens."""
        if self._charge is not None:
            self._charge.tokens = 0
        self._prompt = 0

    def release(self) -> int:
        """Free the slot and settle the reservation; returns the tokens finally charged (0 if none)."""
        if self.released:
            return 0
        self.released = True
        self._limiter.end(self.key)
        if self._charge is None:
            return 0
        self._charge.tokens = min(self._charge.tokens, self._prompt + self.generated)
        return self._charge.tokens


class RateLimiter:
    """The limits of every key in a `KeyTable`; single-threaded (the event loop's)."""

    def __init__(self, table: KeyTable, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage = {key.name: _Usage() for key in table.keys}

    def _now_usage(self, key: ApiKey) -> tuple[float, _Usage]:
        now = self._clock()
        usage = self._usage[key.name]
        usage.forget_before(now - WINDOW_S)
        return now, usage

    def admit(self, key: ApiKey) -> Lease | Refusal:
        """Count a new request against `rpm` and take a slot under `concurrent`."""
        now, usage = self._now_usage(key)
        limits = key.limits
        if limits.rpm is not None and len(usage.admitted) >= limits.rpm:
            wait = usage.admitted[0] + WINDOW_S - now
            return Refusal(LimitKind.RPM, _seconds(wait), f"{limits.rpm} requests per minute")
        if limits.concurrent is not None and usage.in_flight >= limits.concurrent:
            # No clock says when a request ends; a slot frees as soon as one of the key's does.
            return Refusal(LimitKind.CONCURRENT, 1, f"{limits.concurrent} concurrent requests")
        usage.admitted.append(now)
        usage.in_flight += 1
        return Lease(self, key)

    def reserve(self, key: ApiKey, tokens: int) -> _Charge | Refusal | TooLarge:
        """Charge `tokens` to the key's minute if they fit under its `tpm`."""
        now, usage = self._now_usage(key)
        limit = key.limits.tpm
        if limit is not None:
            if tokens > limit:
                return TooLarge(tokens, limit)
            used = usage.tokens()
            if used + tokens > limit:
                return Refusal(LimitKind.TPM, _seconds(self._tpm_wait(usage, used, tokens, limit, now)),
                               f"{limit} tokens per minute")
        charge = _Charge(now, tokens)
        usage.charges.append(charge)
        return charge

    @staticmethod
    def _tpm_wait(usage: _Usage, used: int, tokens: int, limit: int, now: float) -> float:
        """Seconds until enough charges leave the minute for `tokens` more (charges can only shrink)."""
        for charge in usage.charges:
            used -= charge.tokens
            if used + tokens <= limit:
                return charge.at + WINDOW_S - now
        return WINDOW_S  # unreachable: tokens <= limit once every charge has left

    def end(self, key: ApiKey) -> None:
        """A request of `key` ended: its concurrency slot is free."""
        self._usage[key.name].in_flight -= 1

    def in_flight(self, key: ApiKey) -> int:
        """Requests of `key` in flight now."""
        return self._usage[key.name].in_flight
