"""The multi-model comparison's figures and its goals' ratios, from a `pdcluster simulate` folder
(or a `pdcluster experiment run` one: the same cells as processes).

```
 DIR/cells/<cell>/summary.json  ─► P99 TTFT, SLO attainment (every SLO)
 DIR/cells/<cell>/timeline*.jsonl ─► replica-seconds: seconds of replicas holding weights (any state
                                    but inactive and dead; a replica leaving a model's pool ends its
                                    span there), summed over every model's pool (virtual time: one
                                    file to the run's end; processes: a file per model, each to its
                                    last record)
 per workload, `live` against `stop-the-world`, `host-cache` and `static-peak` ─► ratios and goals
```
`python -m pdcluster.sim.ratios DIR` prints the JSON (and writes DIR/ratios.json).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FREE = frozenset({"inactive", "dead"})
PEAK = "static"  # the policy of the static-peak system
GOALS = {"p99_ttft_vs_stop_the_world": 0.3, "p99_ttft_vs_host_cache": 0.5,
         "replica_seconds_vs_static_peak": 0.6, "slo_points_vs_static_peak": -2.0}


def replica_seconds(timeline: Iterable[dict[str, Any]], end: float) -> float:
    """Virtual seconds replicas held weights (`t` of replica, transition and replica_left records)."""
    current: dict[int, tuple[float, str]] = {}
    total = 0.0
    for r in timeline:
        if r.get("kind") not in ("replica", "transition", "replica_left"):
            continue
        rid, t = int(r["replica"]), float(r["t"])
        if rid in current:
            since, state = current.pop(rid)
            total += 0.0 if state in FREE else t - since
        if r["kind"] != "replica_left":
            current[rid] = (t, str(r["state"] if r["kind"] == "replica" else r["target"]))
    return total + sum(max(0.0, end - since) for since, state in current.values() if state not in FREE)


def cell_figures(folder: Path) -> dict[str, Any]:
    """One cell's policy, workload, P99 TTFT (ms), SLO attainment (%) and replica-seconds."""
    summary = json.loads((folder / "summary.json").read_text())
    virtual = summary.get("virtual_seconds")
    # virtual time: one timeline to the run's end; processes: a timeline per model, to the cell's end
    status = None if virtual is not None else json.loads((folder / "status.json").read_text())
    finished = None if status is None else float(status["finished"])
    held = 0.0
    for path in sorted(folder.glob("timeline*.jsonl")):
        with path.open(encoding="utf-8") as f:
            timeline = [json.loads(line) for line in f if line.strip()]
        end = float(virtual) if finished is None else _on_clock(finished, timeline)
        held += replica_seconds(timeline, end)
    policy = folder.name.split("@")[0].rsplit(".", 1)[-1]
    return {"policy": policy, "workload": summary["workload"], "p99_ttft_ms": summary["p99_ttft_ms"],
            "slo_attainment_pct": 100 * summary["slo_attainment"]["all"], "replica_seconds": held}


def _on_clock(wall: float, timeline: list[dict[str, Any]]) -> float:
    """Wall-clock time `wall` on `timeline`'s own clock (a process cell writes a timeline per model,
    each from its own start), through its first record's `t` and `wall`."""
    first = next((r for r in timeline if "t" in r and "wall" in r), None)
    return 0.0 if first is None else float(first["t"]) + wall - float(first["wall"])


def ratios(cells: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per workload: `live` against the others, each ratio beside its goal and whether it is met."""
    out: dict[str, dict[str, Any]] = {}
    for workload in sorted({c["workload"] for c in cells}):
        by = {c["policy"]: c for c in cells if c["workload"] == workload}
        live, figures = by.get("live"), {}
        if live is None:
            continue
        pairs = {"p99_ttft_vs_stop_the_world": ("stop-the-world", "p99_ttft_ms"),
                 "p99_ttft_vs_host_cache": ("host-cache", "p99_ttft_ms"),
                 "replica_seconds_vs_static_peak": (PEAK, "replica_seconds")}
        for name, (other, key) in pairs.items():
            if other in by and by[other][key]:
                value = live[key] / by[other][key]
                figures[name] = {"ratio": round(value, 3), "goal": GOALS[name], "met": value <= GOALS[name]}
        if PEAK in by:
            points = live["slo_attainment_pct"] - by[PEAK]["slo_attainment_pct"]
            name = "slo_points_vs_static_peak"
            figures[name] = {"points": round(points, 2), "goal": GOALS[name], "met": points >= GOALS[name]}
        out[workload] = {"cells": by, "ratios": figures}
    return out


def main(argv: list[str] | None = None) -> int:
    """Print (and write DIR/ratios.json) the ratios of a simulate folder."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pdcluster.sim.ratios DIR (a `pdcluster simulate` or `experiment run` folder)",
              file=sys.stderr)
        return 2
    root = Path(args[0])
    cells = [cell_figures(d) for d in sorted((root / "cells").iterdir()) if (d / "summary.json").is_file()]
    result = json.dumps(ratios(cells), indent=1)
    (root / "ratios.json").write_text(result + "\n")
    print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
