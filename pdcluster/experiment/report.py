"""`pdcluster experiment report DIR`: `DIR/report.md` and `DIR/plots/*.png`, rebuilt from the cells on disk.

The report opens with which system wins each workload (highest share of requests meeting every SLO,
then lowest P99 TTFT), then one table row per cell, the figures, the cells that failed or were
skipped with their reasons, and the metric definitions.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdcluster.experiment import plots
from pdcluster.experiment.results import CellResult, load_results

DEFINITIONS = """\
## Metric definitions

As vLLM's serving benchmark (`benchmark_serving.py`) defines them; times from the client's side,
each request timed from the moment it was sent:
- **TTFT**: time to the first streamed token.
- **TPOT**: (E2EL − TTFT) / (output tokens − 1), for requests with at least two output tokens.
- **ITL**: every gap between two consecutive streamed tokens (all requests pooled).
- **E2EL**: time to the end of the response.
- **Throughput**: completed requests (or tokens) / the run's duration (first send to last answer).
- **Goodput**: requests meeting every SLO / the run's duration (a one-token request counts TPOT 0).
- **SLO attainment**: the share of *all* requests (failed ones miss) meeting one SLO, or all of them.
- **Migration**: per request, the KV bytes its route reports and the time of its batch's migration.
"""


def write_report(out: Path) -> Path:
    """Write `out/report.md` and its plots from the cell folders under `out/cells`."""
    results = load_results(out)
    figures = _figures(results, out / "plots")
    lines = [f"# Experiment `{_name(out)}`", "", _counts(results), ""]
    lines += _context(results)
    lines += _winners(results)
    lines += _cells_table(results)
    lines += ["## Figures", ""]
    for caption, path in figures:
        if path is None:
            lines += [f"- {caption}: nothing to draw in these cells.", ""]
        else:
            lines += [f"**{caption}**", "", f"![{caption}](plots/{path.name})", ""]
    lines += _problems(results)
    lines += [DEFINITIONS]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def _name(out: Path) -> str:
    source = out / "experiment.toml"
    if source.is_file():
        import tomllib

        try:
            return str(tomllib.loads(source.read_text()).get("name", out.name))
        except tomllib.TOMLDecodeError:
            pass
    return out.name


def _counts(results: Sequence[CellResult]) -> str:
    states: dict[str, int] = defaultdict(int)
    for r in results:
        states[r.state] += 1
    parts = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    return f"{len(results)} cells: {parts or 'none yet'}."


def _context(results: Sequence[CellResult]) -> list[str]:
    slos = next((r.summary.get("slos_ms") for r in results if r.summary.get("slos_ms")), None)
    text = ", ".join(f"{k.upper()} ≤ {v:g} ms" for k, v in slos.items()) if slos else "none given"
    return [f"SLOs: {text}. Labels name what differs between the systems measured.", ""]


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _grouped(results: Sequence[CellResult]) -> dict[tuple[str, str], list[CellResult]]:
    groups: dict[tuple[str, str], list[CellResult]] = defaultdict(list)
    for r in results:
        if r.state == "done":
            groups[(r.workload, r.label)].append(r)
    return groups


def _winners(results: Sequence[CellResult]) -> list[str]:
    groups = _grouped(results)
    if not groups:
        return []
    lines = ["## Which system wins where", "",
             "| workload | best | requests meeting all SLOs | P99 TTFT (ms) | runner-up |",
             "|---|---|---:|---:|---|"]
    for workload in sorted({w for w, _ in groups}, key=lambda w: (w.partition("@")[0], _rate(groups, w))):
        ranked = sorted(((_score(cells), label) for (w, label), cells in groups.items() if w == workload))
        (attain, p99), best = ranked[0]
        second = ranked[1][1] if len(ranked) > 1 else "—"
        lines.append(f"| {workload} | **{best}** | {_percent(-attain)} | {p99:.0f} | {second} |")
    return [*lines, "", "Ranked by the share of requests meeting every SLO, then by P99 TTFT "
            "(means over repetitions).", ""]


def _rate(groups: dict[tuple[str, str], list[CellResult]], workload: str) -> float:
    return next(cells[0].rate for (w, _), cells in groups.items() if w == workload)


def _score(cells: Sequence[CellResult]) -> tuple[float, float]:
    """(−attainment, P99 TTFT): lower is better; no SLOs count as full attainment."""
    attain = _mean([c.summary.get("slo_attainment", {}).get("all", 1.0) for c in cells])
    return -attain, _mean([c.summary.get("p99_ttft_ms", math.inf) for c in cells])


def _percent(share: float) -> str:
    return "—" if math.isnan(share) else f"{100 * share:.0f} %"


COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.0f}"),
    ("TTFT mean", "mean_ttft_ms", "{:.0f}"),
    ("TTFT P50", "p50_ttft_ms", "{:.0f}"),
    ("TTFT P99", "p99_ttft_ms", "{:.0f}"),
    ("TPOT mean", "mean_tpot_ms", "{:.1f}"),
    ("TPOT P99", "p99_tpot_ms", "{:.1f}"),
    ("ITL P99", "p99_itl_ms", "{:.1f}"),
    ("E2EL P99", "p99_e2el_ms", "{:.0f}"),
    ("goodput", "request_goodput", "{:.2f}"),
    ("KV MiB", "migration_bytes", "MiB"),
    ("migr. ms", "mean_migration_ms", "{:.1f}"),
)


def _cells_table(results: Sequence[CellResult]) -> list[str]:
    done = [r for r in results if r.state == "done"]
    if not done:
        return []
    head = ["system", "workload", "rep", "ok/all", "SLO all", *(c[0] for c in COLUMNS)]
    lines = ["## Cells", "", "Times in ms, throughput per second, goodput in requests/s.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(head) - 4)]
    for r in sorted(done, key=lambda r: (r.family, r.rate, r.label, r.rep)):
        s = r.summary
        attain = s.get("slo_attainment", {}).get("all")
        row = [r.label, r.workload, str(r.rep), f"{s.get('completed', 0)}/{s.get('num_requests', '?')}",
               "—" if attain is None else _percent(attain), *(_cell(s, key, fmt) for _, key, fmt in COLUMNS)]
        lines.append("| " + " | ".join(row) + " |")
    return [*lines, ""]


def _cell(summary: dict[str, Any], key: str, fmt: str) -> str:
    value = summary.get(key)
    if value is None:
        return "—"
    if fmt == "MiB":
        return f"{value / 2**20:.1f}"
    return fmt.format(value)


def _problems(results: Sequence[CellResult]) -> list[str]:
    bad = [r for r in results if r.state != "done"]
    if not bad:
        return []
    lines = ["## Cells that did not finish", "", "| cell | state | why |", "|---|---|---|"]
    for r in bad:
        reason = str(r.status.get("error", "interrupted (no status)")).splitlines()
        lines.append(f"| {r.key} | {r.state} | {(reason[0] if reason else '').replace('|', '/')} |")
    return [*lines, ""]


WHY_EMPTY = {
    "slo_vs_rate.png": "no finished cell with SLOs and a finite request rate",
    "p99_ttft_vs_rate.png": "no finished cell with a finite request rate",
    "replicas_timeline.png": "no replica states recorded (a pdcluster router's /metrics or timeline)",
    "migration_vs_bytes.png": "no request migrated KV (colocated, mutate, or external servers only)",
}


def _figures(results: Sequence[CellResult], folder: Path) -> list[tuple[str, Path | None]]:
    drawn = [
        ("TTFT CDF per workload", plots.cdf(results, "ttft", folder / "ttft_cdf.png"), "ttft_cdf.png"),
        ("TPOT CDF per workload", plots.cdf(results, "tpot", folder / "tpot_cdf.png"), "tpot_cdf.png"),
        ("SLO attainment vs offered load", plots.slo_vs_rate(results, folder / "slo_vs_rate.png"),
         "slo_vs_rate.png"),
        ("P99 TTFT vs offered load", plots.p99_ttft_vs_rate(results, folder / "p99_ttft_vs_rate.png"),
         "p99_ttft_vs_rate.png"),
        ("Replicas per state over time, with the request rate",
         plots.replicas_timeline(results, folder / "replicas_timeline.png"), "replicas_timeline.png"),
        ("Migration time vs KV bytes", plots.migration_vs_bytes(results, folder / "migration_vs_bytes.png"),
         "migration_vs_bytes.png"),
    ]
    figures = []
    for caption, path, name in drawn:
        if path is None:
            plots.placeholder(folder / name, f"{caption}: {WHY_EMPTY.get(name, 'no finished cell')}")
        figures.append((caption, path))
    return figures
