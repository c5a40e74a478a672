"""`bench serving --long-prompt-len N` and `--compare-long-prompt`: what one long prompt does to the
decode of the requests already running (colocated chunked prefill, issue 25 item 4).

`--long-prompt-len N` adds one request with an N-token prompt to the workload, sent when half of
the others have been (it is the last record: index `--num`). Every summary holds the TPOT and ITL
of the requests other than a long prompt (`regular_*`; all of them when there is none) and the
long prompt's TTFT (0 without one). `--compare-long-prompt` runs the
workload on three fresh local clusters: `baseline` without the long prompt, `chunked` with it (the
router's default `--chunked-prefill`), `unchunked` with it and `--no-chunked-prefill`; the summary
holds each run and the regular requests' TPOT / ITL P99 ratios to the baseline (the goal: the
chunked run within 2×).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from pdcluster.bench.serving.stats import RequestRecord, percentile
from pdcluster.bench.serving.workload import Arrival

LONG_RUNS = {  # name: (with the long prompt, the router's --chunked-prefill)
    "baseline": (False, True),
    "chunked": (True, True),
    "unchunked": (True, False),
}
LONG_KEYS = ("completed", "failed", "duration", "regular_median_tpot_ms", "regular_p99_tpot_ms",
             "regular_median_itl_ms", "regular_p99_itl_ms", "regular_max_itl_ms", "long_prompt_ttft_ms",
             "output_throughput")


def with_long_prompt(arrivals: Sequence[Arrival], length: int, output_len: int) -> list[Arrival]:
    """`arrivals` and, last in the list, one request of `length` prompt tokens sent with the middle one."""
    if not arrivals:
        return [Arrival(0.0, length, output_len)]
    middle = sorted(a.at for a in arrivals)[len(arrivals) // 2]
    return [*arrivals, Arrival(middle, length, output_len)]


def regular_summary(records: Sequence[RequestRecord], long_index: int) -> dict[str, float]:
    """TPOT and ITL of the requests other than the long prompt's (record `long_index`), in ms, and
    the long prompt's TTFT."""
    regular = [r for r in records if r.success and r.index != long_index]
    tpots = [t * 1000.0 for r in regular if (t := r.tpot) is not None]
    itls = [gap * 1000.0 for r in regular for gap in r.itl]
    out = {
        "regular_median_tpot_ms": statistics.median(tpots) if tpots else 0.0,
        "regular_p99_tpot_ms": percentile(tpots, 99),
        "regular_median_itl_ms": statistics.median(itls) if itls else 0.0,
        "regular_p99_itl_ms": percentile(itls, 99),
        "regular_max_itl_ms": max(itls, default=0.0),
    }
    long = [r for r in records if r.index == long_index and r.success]
    out["long_prompt_ttft_ms"] = long[0].ttft * 1000.0 if long else 0.0
    return out


def long_prompt_ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each run with the long prompt against the baseline: regular requests' TPOT / ITL P99 ratios."""
    base = runs["baseline"]
    out: dict[str, float] = {}
    for name in ("chunked", "unchunked"):
        for key in ("regular_p99_tpot_ms", "regular_p99_itl_ms"):
            theirs, mine = runs[name].get(key, 0.0), base.get(key, 0.0)
            out[f"{name}_{key.removeprefix('regular_').removesuffix('_ms')}_vs_baseline"] = (
                theirs / mine if mine else 0.0)
    return out
