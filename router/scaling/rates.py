"""The speeds the planner reads, measured while serving (pure Python, injected clock).

- arriving prompt tokens per second: a sliding window over submissions, and a short one (the surge
  window) in which a step in load shows within a fraction of a second;
- one replica's prefill tokens per second: a running average over prefill calls (tokens / call time);
- one decode replica's migration intake, tokens per second: a running average over migrations;
- each decode replica's seconds per decode step (its requests' TPOT): a running average over the
  intervals between its step results (a gap over STEP_GAP_S is idleness, not a step).
Until the first measurement, the configured estimates stand in (0 = unknown: the planner then
keeps the prefill count as it is).
"""

from __future__ import annotations

from collections import deque

STEP_GAP_S = 1.0  # a longer interval between two step results is a pause of the batch, not a step


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
        self.steps: dict[int, RunningAverage] = {}  # replica id → seconds per decode step
        self._last_step: dict[int, float] = {}

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

    def stepped(self, replica: int, now: float, continuing: bool = True) -> None:
        """A decode step result of `replica` arrived at `now`; `continuing`: its batch goes on (else
        the next step starts a new batch after a pause, and its interval is no step time)."""
        last = self._last_step.pop(replica, None)
        if continuing:
            self._last_step[replica] = now
        if last is not None and 0 < now - last <= STEP_GAP_S:
            self.steps.setdefault(replica, RunningAverage()).add(now - last)

    def tpot(self, replica: int) -> float:
        """`replica`'s measured seconds per decode step (0 = not measured)."""
        average = self.steps.get(replica)
        return average.value if average is not None else 0.0
