"""`scaling.json`: the run's design, each system's figures, the goals; and the table printed after it.

```
 {"design": {phases, replicas, bandwidths, load seconds, SLOs, checkpoint bytes},
  "systems": {"live": {ttft_ms, tpot_ms, slo_attainment, replica_seconds, burst_to_new_replica_token_s,
                       weight_bytes, …, "timeline_png": "plots/timelines/<cell>.png"}, …},
  "goals": [{"goal", "ratio", "limit", "met"}, …],
  "ratios": {"live": {"static-peak": {"ttft_ms.p99": …, "during_burst.ttft_ms.p99": …, …}, …}, …},
  "report": "report.md", "missing": [systems not done]}
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdcluster.experiment.results import CellResult, load_results
from pdcluster.experiment.scaling.design import PEAK, Design, Reference
from pdcluster.experiment.scaling.figures import goals, ratios, system_figures


def system_of(cell: CellResult) -> str:
    """Which system a cell measured (its cluster and policy)."""
    return PEAK if cell.part("cluster") == "peak" else cell.part("policy")


def describe(design: Design) -> dict[str, Any]:
    """The design as scaling.json records it, with the load times its bandwidths give."""
    b, size, ref = design.bandwidths, int(design.notes.get("checkpoint_bytes", 0)), Reference()

    def seconds(gbps: float) -> float | None:
        return round(size * 8 / (gbps * 1e9), 2) if size and gbps else None

    prefill, decode = design.peak
    return {
        "phases": [list(p) for p in design.phases], "input_len": list(design.input_len),
        "output_len": list(design.output_len),
        "cluster": {"prefill": 1, "decode": 1, "inactive": design.inactive},
        "static_peak": {"prefill": prefill, "decode": decode},
        "planner_args": design.planner_args(), "checkpoint_bytes": size, "model": str(design.model),
        "bandwidths_gbps": {"link": b.link_gbps, "disk": b.disk_gbps, "host": b.host_gbps},
        "load_seconds": {"p2p": seconds(b.link_gbps), "disk": seconds(b.disk_gbps),
                         "host": seconds(b.host_gbps)},
        "reference_load_seconds": {"p2p": ref.seconds(ref.nic_gbps), "disk": ref.seconds(ref.disk_gbps),
                                   "host": ref.seconds(ref.host_gbps)},
        "slo_ms": {"ttft": design.slo_ttft_ms, "tpot": design.slo_tpot_ms},
    }


def scaling_results(out: Path, design: Design) -> dict[str, Any]:
    """Everything scaling.json holds, from the experiment folder `out`."""
    systems: dict[str, dict[str, Any]] = {}
    for cell in load_results(out):
        if cell.state == "done" and cell.rep == 0:
            figures = system_figures(cell, design.phases)
            png = out / "plots" / "timelines" / f"{cell.key}.png"
            figures["timeline_png"] = str(png.relative_to(out)) if png.is_file() else None
            systems[system_of(cell)] = figures
    order = [s for s in design.systems if s in systems]
    return {"design": describe(design), "systems": {s: systems[s] for s in order}, "goals": goals(systems),
            "ratios": ratios({s: systems[s] for s in order}),
            "report": "report.md", "missing": [s for s in design.systems if s not in systems]}


def _ms(value: Any) -> str:
    return "—" if value is None else f"{value:.0f}"


def _s(value: Any) -> str:
    return "—" if value is None else f"{value:.1f}"


def _cores(value: Any) -> str:
    return "—" if value is None else f"{value:.2f}"


def _share(attainment: dict[str, float]) -> str:
    value = attainment.get("all")
    return "—" if value is None else f"{100 * value:.0f} %"


def table(results: dict[str, Any]) -> str:
    """The figures as a Markdown table, then the goals."""
    head = ("| system | TTFT P50 / P90 / P99 (ms) | TPOT P50 / P90 / P99 (ms) | SLO all "
            "| in the burst: TTFT P50 / P99 (ms), TPOT P99 (ms), SLO all | replica-s "
            "| burst → scale-up / new replica's token (s) | weights moved (MB) | cores used | ok/all |")
    lines = [head, "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, f in results["systems"].items():
        ttft, tpot, burst = f["ttft_ms"], f["tpot_ms"], f["during_burst"]
        lines.append(
            f"| {name} | {' / '.join(_ms(ttft[q]) for q in ('p50', 'p90', 'p99'))} "
            f"| {' / '.join(_ms(tpot[q]) for q in ('p50', 'p90', 'p99'))} "
            f"| {_share(f['slo_attainment'])} "
            f"| {_ms(burst['ttft_ms']['p50'])} / {_ms(burst['ttft_ms']['p99'])}, "
            f"{_ms(burst['tpot_ms']['p99'])}, "
            f"{_share(burst['slo_attainment'])} | {_s(f['replica_seconds'])} "
            f"| {_s(f['burst_to_scale_up_s'])} / {_s(f['burst_to_new_replica_token_s'])} "
            f"| {f['weight_bytes'] / 1e6:.0f} | {_cores(f['cores_busy'])} "
            f"| {f['completed']}/{f['requests']} |")
    lines.append("")
    for g in results["goals"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        ratio = "—" if g["ratio"] is None else f"{g['ratio']:.2f}"
        lines.append(f"- {g['goal']}: ratio {ratio} (limit {g['limit']:g}) — {verdict}")
    if results["missing"]:
        lines.append(f"- not measured (cell not done): {', '.join(results['missing'])}")
    return "\n".join(lines)
