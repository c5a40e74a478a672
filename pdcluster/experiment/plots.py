"""The report's figures, drawn with matplotlib's Agg backend into PNG files (no display needed).

- `ttft_cdf.png`, `tpot_cdf.png`: per workload, the CDF of TTFT / TPOT of each system (all repetitions);
- `slo_vs_rate.png`: per workload family, the share of requests meeting every SLO against the offered
  rate; `p99_ttft_vs_rate.png`: P99 TTFT against it;
- `replicas_timeline.png`: per cell (first repetition), replicas in each state over time, and the
  requests sent per second;
- `migration_vs_bytes.png`: per migrated batch, its migration time against its KV bytes, by system.

Each function returns the file it wrote, or None when the cells hold nothing to draw (the report
then draws `placeholder`, so every figure file exists).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; must precede pyplot's import
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pdcluster.experiment.results import CellResult

MAX_PANELS = 12


def _grid(n: int, width: float = 4.6, height: float = 3.4) -> tuple[Figure, list[Axes]]:
    cols = min(3, max(1, n))
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _done(results: Sequence[CellResult]) -> list[CellResult]:
    return [r for r in results if r.state == "done"]


def _ordered_workloads(results: Sequence[CellResult]) -> list[str]:
    return sorted({r.workload for r in results}, key=lambda w: (w.partition("@")[0], _rate_of(results, w)))


def _rate_of(results: Sequence[CellResult], workload: str) -> float:
    return next((r.rate for r in results if r.workload == workload), math.inf)


def _values(results: Sequence[CellResult], metric: str) -> list[float]:
    """Milliseconds of `metric` (ttft, tpot) over the successful requests of `results`."""
    values = []
    for r in results:
        for q in r.requests():
            if not q.get("success"):
                continue
            if metric == "ttft":
                values.append(1000.0 * q["ttft"])
            elif q.get("tpot") is not None:
                values.append(1000.0 * q["tpot"])
    return values


def cdf(results: Sequence[CellResult], metric: str, path: Path) -> Path | None:
    """CDF of TTFT or TPOT per workload, one line per system."""
    done = _done(results)
    workloads = _ordered_workloads(done)[:MAX_PANELS]
    if not workloads:
        return None
    fig, axes = _grid(len(workloads))
    name = {"ttft": "TTFT", "tpot": "TPOT"}[metric]
    for ax, workload in zip(axes, workloads, strict=True):
        by_label: dict[str, list[CellResult]] = defaultdict(list)
        for r in done:
            if r.workload == workload:
                by_label[r.label].append(r)
        spread = []
        for label, cells in sorted(by_label.items()):
            values = sorted(_values(cells, metric))
            if values:
                shares = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, shares, where="post", label=label)
                spread += [values[0], values[-1]]
        if spread and min(spread) > 0 and max(spread) / min(spread) > 50:
            ax.set_xscale("log")
        ax.set(title=workload, xlabel=f"{name} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def _by_family(results: Sequence[CellResult], value: Callable[[CellResult], float | None]
               ) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """family → label → sorted (rate, mean over repetitions of `value`), finite rates only."""
    sums: dict[tuple[str, str, float], list[float]] = defaultdict(list)
    for r in _done(results):
        v = value(r)
        if v is not None and math.isfinite(r.rate):
            sums[(r.family, r.label, r.rate)].append(v)
    out: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for (family, label, rate), values in sorted(sums.items()):
        out[family][label].append((rate, sum(values) / len(values)))
    return out


def _versus_rate(results: Sequence[CellResult], value: Callable[[CellResult], float | None], ylabel: str,
                 path: Path, ylim: tuple[float, float] | None = None) -> Path | None:
    families = _by_family(results, value)
    if not families:
        return None
    fig, axes = _grid(min(len(families), MAX_PANELS))
    for ax, (family, lines) in zip(axes, sorted(families.items())[:MAX_PANELS], strict=True):
        for label, points in sorted(lines.items()):
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set(title=family, xlabel="offered load (requests/s)", ylabel=ylabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def slo_vs_rate(results: Sequence[CellResult], path: Path) -> Path | None:
    """Share of requests meeting every SLO against the offered rate."""
    def attained(r: CellResult) -> float | None:
        share = r.summary.get("slo_attainment", {}).get("all")
        return None if share is None else 100.0 * share

    return _versus_rate(results, attained, "requests meeting all SLOs (%)", path, (-2, 102))


def p99_ttft_vs_rate(results: Sequence[CellResult], path: Path) -> Path | None:
    """P99 TTFT against the offered rate."""
    return _versus_rate(results, lambda r: r.summary.get("p99_ttft_ms"), "P99 TTFT (ms)", path)


def replica_states(cell: CellResult) -> dict[str, list[tuple[float, int]]]:
    """state → [(t, replicas in that state)], from the router's timeline transitions when it wrote
    them, else from the sampled roles of /metrics."""
    transitions = [t for t in cell.timeline() if t.get("kind") == "transition"]
    if transitions:
        return _from_transitions(cell, transitions)
    counts: dict[float, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in cell.resources():
        if row.get("kind") == "replica" and row.get("role"):
            counts[row["t"]][row["role"]] += 1
    states = sorted({s for c in counts.values() for s in c})
    return {s: [(t, counts[t].get(s, 0)) for t in sorted(counts)] for s in states}


def _from_transitions(cell: CellResult, transitions: list[dict[str, Any]]
                      ) -> dict[str, list[tuple[float, int]]]:
    """Replay transitions (router wall clock) on the load's clock (`wall_start` of the summary)."""
    wall0 = float(cell.summary.get("wall_start", transitions[0].get("wall", 0.0)))
    where: dict[str, str] = {}
    series: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for record in sorted(transitions, key=lambda t: t.get("wall", 0.0)):
        where[str(record.get("replica"))] = str(record.get("target"))
        t = float(record.get("wall", wall0)) - wall0
        for state in {*where.values(), *series}:
            series[state].append((t, sum(1 for s in where.values() if s == state)))
    return dict(series)


def aligned(series: dict[str, list[tuple[float, int]]]) -> tuple[list[float], dict[str, list[int]]]:
    """The states' step series on one time grid: each count holds until its next point (0 before
    its first), so they can be stacked."""
    times = sorted({t for points in series.values() for t, _ in points})
    counts: dict[str, list[int]] = {}
    for state, points in series.items():
        at = dict(points)  # the last point of a time wins
        value, column = 0, []
        for t in times:
            value = at.get(t, value)
            column.append(value)
        counts[state] = column
    return times, counts


def arrivals_per_second(cell: CellResult) -> list[tuple[float, int]]:
    """(second, requests sent in it) over the cell's run."""
    starts = [q.get("start", 0.0) for q in cell.requests()]
    if not starts:
        return []
    counts: dict[int, int] = defaultdict(int)
    for s in starts:
        counts[int(s)] += 1
    return [(float(s), counts.get(s, 0)) for s in range(int(max(starts)) + 1)]


def replicas_timeline(results: Sequence[CellResult], path: Path) -> Path | None:
    """Replicas per state over time, with the request rate on a second axis; one panel per cell."""
    cells = sorted((r for r in _done(results) if r.rep == 0 and replica_states(r)),
                   key=lambda r: (r.label, r.family, r.rate))[:MAX_PANELS]
    if not cells:
        return None
    fig, axes = _grid(len(cells), width=5.2)
    for ax, cell in zip(axes, cells, strict=True):
        times, counts = aligned(replica_states(cell))
        states = sorted(counts)
        ax.stackplot(times, *(counts[s] for s in states), labels=states, step="post", alpha=0.8)
        top = max((sum(c[i] for c in counts.values()) for i in range(len(times))), default=1)
        ax.set(title=f"{cell.label} · {cell.workload}", xlabel="time since the load started (s)",
               ylabel="replicas (stacked by state)", ylim=(0, top + 0.5))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        rate = ax.twinx()
        per_second = arrivals_per_second(cell)
        rate.step([p[0] for p in per_second] + [len(per_second)], [p[1] for p in per_second] + [0],
                  where="post", color="black", linewidth=1.2, label="requests sent per s")
        rate.set_ylabel("requests sent (per s)")
        lines, labels = ax.get_legend_handles_labels()
        more, more_labels = rate.get_legend_handles_labels()
        ax.legend(lines + more, labels + more_labels, fontsize="small", loc="upper right")
    return _save(fig, path)


def migrated_batches(cell: CellResult) -> list[tuple[int, float]]:
    """(KV bytes, seconds) of each migrated batch: a batch's requests report its migration time, each
    its own bytes, so requests with the same route replicas and time are one batch."""
    batches: dict[tuple[Any, Any, float], int] = defaultdict(int)
    for q in cell.requests():
        route = q.get("route") or {}
        if route.get("migration_bytes"):
            key = (route.get("prefill_replica"), route.get("decode_replica"), route["migration_seconds"])
            batches[key] += int(route["migration_bytes"])
    return [(nbytes, key[2]) for key, nbytes in batches.items()]


def migration_vs_bytes(results: Sequence[CellResult], path: Path) -> Path | None:
    """Each migrated batch: its migration time against its KV bytes, by system."""
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in _done(results):
        points[r.label] += [(nbytes / 2**20, 1000.0 * seconds) for nbytes, seconds in migrated_batches(r)]
    if not any(points.values()):
        return None
    fig, axes = _grid(1, width=6.4, height=4.4)
    ax = axes[0]
    for label, xy in sorted(points.items()):
        if xy:
            ax.scatter([p[0] for p in xy], [p[1] for p in xy], s=14, alpha=0.7, label=label)
    ax.set(xlabel="KV bytes of the batch (MiB)", ylabel="migration time of the batch (ms)",
           title="migration time vs KV bytes (one point per migrated batch)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def placeholder(path: Path, text: str) -> Path:
    """A figure that says why there is nothing to draw."""
    fig, axes = _grid(1, width=6.4, height=2.0)
    axes[0].axis("off")
    axes[0].text(0.5, 0.5, text, ha="center", va="center", wrap=True)
    return _save(fig, path)
