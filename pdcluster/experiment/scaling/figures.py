"""Per-system figures of a scaling run and its goals, from the harness's cell folders (pure but for
reading them through `CellResult`).

```
 CellResult (summary.json, requests.jsonl, timeline.jsonl) ─► system_figures ─► {"live": {...}, …}
                                                                     └─► goals: live against
                                                                         stop-the-world and static-peak
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdcluster.experiment.results import CellResult
from pdcluster.experiment.scaling import metrics
from pdcluster.experiment.scaling.design import PEAK


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def _percentiles(summary: dict[str, Any], metric: str) -> dict[str, float | None]:
    return {f"p{q}": _round(summary.get(f"p{q}_{metric}_ms"), 1) for q in (50, 90, 99)}


def system_figures(cell: CellResult, phases: tuple[tuple[float, float], ...]) -> dict[str, Any]:
    """What one system did under the burst: latencies, SLOs, cost, reaction, bytes moved."""
    s = cell.summary
    timeline, requests = cell.timeline(), cell.requests()
    begin = float(s.get("wall_start", 0.0))
    duration = float(s.get("duration", 0.0))
    burst, burst_end = metrics.burst_window(phases)
    new = metrics.new_replicas(timeline)
    loading = {"loading_prefill", "loading_decode", "new_prefill"}
    # any replica loading weights after the burst started was scaled up (one that began serving may
    # have been drained and expired before the burst, and be the one loaded again)
    started = metrics.first_change(timeline, metrics.every_replica(timeline), loading, begin + burst)
    first_load = metrics.first_change(timeline, new, loading, begin)
    serving = metrics.first_change(timeline, new, metrics.SERVING, begin + burst)
    token = metrics.first_token_by(requests, new, burst)
    moved = metrics.weights_moved(timeline)
    cost = metrics.replica_seconds(timeline, begin, begin + duration) if timeline else math.nan
    return {
        "cell": cell.key,
        "requests": s.get("num_requests"), "completed": s.get("completed"), "failed": s.get("failed"),
        "duration_s": _round(duration),
        "ttft_ms": _percentiles(s, "ttft"), "tpot_ms": _percentiles(s, "tpot"),
        "slo_attainment": s.get("slo_attainment", {}),
        # the requests sent during the busiest phase: what scaling is for
        "during_burst": metrics.latency_figures(metrics.arrived_within(requests, burst, burst_end),
                                                dict(s.get("slos_ms") or {})),
        "replica_seconds": _round(cost, 1),
        # how much CPU the cell itself got: on shared cores, the rest went to other work
        "cpu_seconds": _round(metrics.cpu_seconds(cell.resources(), 0.0, duration), 1),
        "cores_busy": _round(metrics.cpu_seconds(cell.resources(), 0.0, duration) / duration
                             if duration else None, 2),
        "mean_replicas": _round(cost / duration if duration else math.nan, 2),
        "burst_at_s": burst,
        # a cluster that scales up before the burst found even the quiet load too much
        "first_scale_up_at_s": _round(first_load - begin if first_load is not None else None),
        "burst_to_scale_up_s": _round(started - begin - burst if started is not None else None),
        "burst_to_new_replica_serving_s": _round(serving - begin - burst if serving is not None else None),
        "burst_to_new_replica_token_s": _round(token - burst if token is not None else None),
        "requests_served_by_new_replicas": sum(1 for q in requests if metrics.token_times(q, new)),
        "requests_prefilled_while_loading": sum(1 for q in requests
                                                if (q.get("route") or {}).get("loading_prefill")),
        "weight_bytes": sum(m.bytes for m in moved.values()),
        "weight_transfers": {method: m.to_json() for method, m in sorted(moved.items())},
        "kv_bytes": metrics.kv_bytes(requests),
    }


@dataclass(frozen=True)
class Goal:
    """One of the issue's goals: `ratio` of `system` to `against` must be at most `limit`."""

    name: str
    metric: str  # a key path into a system's figures ("ttft_ms.p99", "replica_seconds")
    system: str
    against: str
    limit: float

    def evaluate(self, figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """{"goal", "ratio", "limit", "met"}: met is None when either side was not measured."""
        mine, theirs = _value(figures.get(self.system), self.metric), _value(figures.get(self.against),
                                                                             self.metric)
        ratio = mine / theirs if mine is not None and theirs else None
        return {"goal": self.name, "metric": self.metric, "system": self.system, "against": self.against,
                "value": mine, "baseline": theirs, "ratio": _round(ratio), "limit": self.limit,
                "met": None if ratio is None else ratio <= self.limit}


def _value(figures: dict[str, Any] | None, path: str) -> float | None:
    value: Any = figures
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


GOALS = (
    Goal("live P99 TTFT <= 0.3 x stop-the-world", "ttft_ms.p99", "live", "stop-the-world", 0.3),
    Goal("live P99 TTFT <= 1.5 x static cluster provisioned for the peak", "ttft_ms.p99", "live", PEAK, 1.5),
    Goal("live replica-seconds <= 0.6 x static cluster provisioned for the peak", "replica_seconds", "live",
         PEAK, 0.6),
)
"""Issue 16's goals, each a ratio measured in the same run."""


def goals(figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal evaluated on the run's figures."""
    return [g.evaluate(figures) for g in GOALS]


RATIO_METRICS = ("ttft_ms.p99", "during_burst.ttft_ms.p99", "during_burst.tpot_ms.p99", "replica_seconds")
"""What `ratios` divides by a baseline's value: the whole load's and the burst's tails, and the cost."""
BASELINES = (PEAK, "static", "stop-the-world")


def ratios(figures: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """system → baseline → metric → the system's value ÷ the baseline's (None where either is missing),
    for every baseline that ran (the same run's: the machine's load is the same for both)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for system, mine in figures.items():
        out[system] = {}
        for baseline in BASELINES:
            theirs = figures.get(baseline)
            if theirs is None or baseline == system:
                continue
            row = {}
            for metric in RATIO_METRICS:
                a, b = _value(mine, metric), _value(theirs, metric)
                row[metric] = _round(a / b if a is not None and b else None)
            out[system][baseline] = row
    return out

