"""Where a simulated step's modelled time goes: slept away (a replica process) or tallied (virtual time).

A runner marks the start of each part of a forward and settles it once its modelled seconds are
known, so the Python work of the step itself counts inside the modelled time instead of adding to it.
"""

from __future__ import annotations

import time
from typing import Protocol


class StepClock(Protocol):
    """Turns modelled seconds into the time a step takes."""

    def mark(self) -> float:
        """The start of a part of a forward."""
        ...

    def settle(self, mark: float, seconds: float) -> None:
        """The part that started at `mark` takes `seconds` in all."""
        ...


class SleepClock:
    """Real time: sleep until `mark + seconds` (no drift: a late start is not made up twice)."""

    def mark(self) -> float:
        """Now (CLOCK_MONOTONIC)."""
        return time.monotonic()

    def settle(self, mark: float, seconds: float) -> None:
        """Sleep what is left of `seconds` since `mark`."""
        left = mark + seconds - time.monotonic()
        if left > 0:
            time.sleep(left)


class TallyClock:
    """Virtual time: add up the modelled seconds; the caller advances its own clock by `take()`."""

    def __init__(self) -> None:
        self.pending = 0.0

    def mark(self) -> float:
        """Unused: virtual parts take exactly their modelled time."""
        return 0.0

    def settle(self, mark: float, seconds: float) -> None:
        """Add `seconds` to the tally."""
        self.pending += seconds

    def take(self) -> float:
        """The seconds tallied since the last take."""
        seconds, self.pending = self.pending, 0.0
        return seconds
