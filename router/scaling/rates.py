"""The speeds the planner reads, measured while serving (pure Python, injected clock).

- arriving prompt tokens per second: a sliding window over submissions, and a short one (the surge
  window) in which a step in load shows within a fraction of a second;
- one replica's prefill tokens per second: a running average over prefill calls (tokens / call time);
- one decode replica's migration intake, tokens per second: a running average over migrations.
Until the first measurement, the configured estimates stand in (0 = unknown: the planner then
keeps the prefill count as it is).
"""

from __future__ import annotations

from collections import deque


class WindowRate:
    """Events per second over the last `window` seconds."""

    def __init__(self, window: float) -> None:
        if window <= 0:
            raise ValueError(f"window must be > 0, got {window}")
        self.window = window
        self._events: deque[tuple[float, float]] = deque()
        self._total = 0.0

    def add(self, amount: float, now: float) -> None:
        """`amount` happened at `now`."""
        self._events.append((now, amount))
        self._total += amount
        self._expire(now)

    def rate(self, now: float) -> float:
        """The amount per second over the window ending at `now`."""
        self._expire(now)
        return self._total / self.window

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window:
            self._total -= self._events.popleft()[1]


class RunningAverage:
    """An exponentially weighted average of samples (`weight` for the newest one)."""

    def __init__(self, initial: float = 0.0, weight: float = 0.3) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.value = initial
        self.weight = weight
        self.samples = 0

    def add(self, sample: float) -> None:
        """One more sample (the first one replaces the initial estimate)."""
        self.value = sample if self.samples == 0 else self.value + self.weight * (sample - self.value)
        self.samples += 1


class Rates:
    """What the planner needs to know about speeds."""

    def __init__(self, prefill_estimate: float = 0.0, migration_estimate: float = 0.0,
                 window: float = 5.0, surge_window: float = 0.5) -> None:
        self.arrivals = WindowRate(window)
        self.surge = WindowRate(surge_window)
        self.prefill = RunningAverage(prefill_estimate)
        self.migration = RunningAverage(migration_estimate)

    def arrived(self, prompt_tokens: int, now: float) -> None:
        """A request with `prompt_tokens` was submitted."""
        self.arrivals.add(prompt_tokens, now)
        self.surge.add(prompt_tokens, now)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill call of `tokens` prompt tokens took `seconds`."""
        if tokens > 0 and seconds > 0:
            self.prefill.add(tokens / seconds)

    def migrated(self, tokens: int, seconds: float) -> None:
        """A migration moved the KV of `tokens` tokens in `seconds`."""
        if tokens > 0 and seconds > 0:
            self.migration.add(tokens / seconds)
