"""Does a resource grow without bound? A least-squares line over the second half of the run (pure).

The first half is warm-up (allocator arenas, gRPC channels, thread pools, torch's caches filling);
a leak shows as a steady slope after it. A series (one metric of one process life) grew when its
fitted slope is above the metric's rate limit *and* the growth that slope implies across the window
is above the metric's noise allowance:

- RSS: 2 MiB/min and 16 MiB. 2 MiB/min is ~2.8 GiB a day, which would exhaust a serving host within
  days: unbounded for any real deployment. Below it, arena growth and freed-but-kept pages (glibc,
  gRPC buffers) move RSS by a few MiB per window and are not separable from a leak at 10 s samples.
- open fds: 0.2/min and 4. One descriptor every 5 minutes reaches a 1024 ulimit in ~3.5 days; 4
  covers sockets that are open at one sample and closed at the next.
- threads: 0.2/min and 4, as fds: a pool grows and shrinks by a few workers at sample instants.

A process life that started less than a warm-up (a minute, or half the window if shorter) before
the window (a replica killed and restarted late in the run), that covers less than 80% of the
window, or has fewer than 6 samples there, is reported but not judged: it is still warming up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

MIN_POINTS = 6
MIN_COVER = 0.8
WARM_UP_S = 60.0


@dataclass(frozen=True)
class Limit:
    """When a series counts as growing without bound."""

    per_min: float
    allowance: float


LIMITS: dict[str, Limit] = {
    "rss_mib": Limit(per_min=2.0, allowance=16.0),
    "fds": Limit(per_min=0.2, allowance=4.0),
    "threads": Limit(per_min=0.2, allowance=4.0),
}


@dataclass(frozen=True)
class Point:
    """One sample of one metric of one process life."""

    t: float  # seconds since the run started
    value: float


@dataclass(frozen=True)
class Trend:
    """A fitted series: `grew` is the verdict, `judged` False when the life was too short to judge."""

    process: str
    pid: int
    metric: str
    points: int
    slope_per_min: float
    growth: float  # slope x the window's minutes
    judged: bool
    grew: bool

    def to_json(self) -> dict[str, Any]:
        """A plain dict for the report."""
        return asdict(self)


def slope_per_min(points: list[Point]) -> float:
    """The least-squares slope of value over time, per minute (0 for fewer than two instants)."""
    t = np.array([p.t for p in points])
    if len(points) < 2 or np.ptp(t) == 0:
        return 0.0
    slope, _ = np.polyfit(t / 60.0, np.array([p.value for p in points]), 1)
    return float(slope)


def trend(process: str, pid: int, metric: str, points: list[Point], window: tuple[float, float]) -> Trend:
    """Fit `points` (one process life) over `window` (start, end seconds) and judge them."""
    start, end = window
    inside = [p for p in points if start <= p.t <= end]
    minutes = (end - start) / 60.0
    slope = slope_per_min(inside)
    covered = (inside[-1].t - inside[0].t) / (end - start) if len(inside) > 1 and end > start else 0.0
    warm_up = min(WARM_UP_S, (end - start) / 2)
    born_early = bool(points) and points[0].t <= start - warm_up
    judged = born_early and len(inside) >= MIN_POINTS and covered >= MIN_COVER
    limit = LIMITS[metric]
    grew = judged and slope > limit.per_min and slope * minutes > limit.allowance
    return Trend(process, pid, metric, len(inside), slope, slope * minutes, judged, grew)
