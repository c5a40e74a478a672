"""A cell's summary: vLLM's serving metrics, SLO attainment, and what migration moved (pure).

Adds to `stats.summarize` (TTFT / TPOT / ITL / E2EL mean, median, std and P50/P90/P95/P99 in ms,
throughput, goodput, SLO attainment): the offered rate and the migration figures of the per-request
routes — total KV bytes, and per migrated request the bytes and seconds of its migration.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from pdcluster.bench.serving.stats import RequestRecord, percentile, summarize
from pdcluster.bench.serving.workload import Arrival, offered_rate


def cell_summary(records: Sequence[RequestRecord], duration: float, slos: dict[str, float],
                 arrivals: Sequence[Arrival]) -> dict[str, Any]:
    """Everything the report tabulates about one cell."""
    summary = summarize(records, duration, slos)
    rate = offered_rate(arrivals)
    summary["offered_rate"] = rate if math.isfinite(rate) else "inf"
    summary["num_requests"] = len(records)
    summary.update(migration_summary(records))
    return summary


def migration_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Total migration bytes, migrated requests, their migration seconds (mean, P50, P99) and retries."""
    routes = [r.route for r in records if r.success and r.route]
    moved = [route for route in routes if route.get("migration_bytes")]
    seconds_ms = [1000.0 * float(route.get("migration_seconds") or 0.0) for route in moved]
    return {
        "migration_bytes": sum(int(route.get("migration_bytes") or 0) for route in routes),
        "migrated_requests": len(moved),
        "mean_migration_ms": statistics.fmean(seconds_ms) if seconds_ms else 0.0,
        "p50_migration_ms": percentile(seconds_ms, 50.0),
        "p99_migration_ms": percentile(seconds_ms, 99.0),
        "retries": sum(int(route.get("requeues") or 0) for route in routes),
    }
