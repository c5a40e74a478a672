"""`pdcluster experiment report` from cell folders alone: tables, winners, every figure a PNG, the
replica timeline from a router timeline's transitions."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.experiment.cli import ExperimentReportConfig, report
from pdcluster.experiment.plots import replica_states
from pdcluster.experiment.results import load_results

PNG = b"\x89PNG\r\n\x1a\n"


def cell(out: Path, key: str, strategy: str, rate: float, ttft: float, attained: float) -> Path:
    folder = out / "cells" / key
    folder.mkdir(parents=True)
    (folder / "cell.json").write_text(json.dumps({
        "system": f"1p1d/{strategy}/static@local", "strategy": strategy, "policy": "static", "rep": 0,
        "cluster": {"name": "1p1d"}, "topology": {"name": "local"}, "endpoint": None,
        "workload": {"name": f"chat@{rate:g}", "rate": rate}}))
    (folder / "status.json").write_text(json.dumps({"state": "done"}))
    (folder / "summary.json").write_text(json.dumps({
        "completed": 3, "num_requests": 3, "p99_ttft_ms": ttft, "slo_attainment": {"all": attained},
        "slos_ms": {"ttft": 200.0}, "wall_start": 1000.0, "request_throughput": rate}))
    requests = [{"success": True, "start": 0.5 * i, "ttft": ttft / 1000 * (i + 1) / 3, "tpot": 0.01 * (i + 1),
                 "route": {"migration_bytes": 2**20 * (i + 1), "migration_seconds": 0.01 * (i + 1)}}
                for i in range(3)]
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    return folder


def test_report_tables_winners_and_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cell(out, "a", "full", 2.0, 100.0, 1.0)
    cell(out, "b", "progressive", 2.0, 150.0, 1.0)
    cell(out, "c", "full", 8.0, 400.0, 0.4)
    slow = cell(out, "d", "progressive", 8.0, 250.0, 0.6)
    (slow / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"t": 0.1, "wall": 1000.0, "kind": "transition", "replica": 0, "source": "idle", "target": "prefill"},
        {"t": 0.1, "wall": 1000.0, "kind": "transition", "replica": 1, "source": "idle", "target": "decode"},
        {"t": 2.0, "wall": 1002.0, "kind": "transition", "replica": 2, "source": "idle", "target": "decode"},
    ]))
    failed = out / "cells" / "e"
    failed.mkdir()
    (failed / "status.json").write_text(json.dumps({"state": "failed",
                                                    "error": "RuntimeError: router exited"}))
    assert report(ExperimentReportConfig(out)) == 0
    text = (out / "report.md").read_text()
    assert "| chat@2 | **full** | 100 % | 100 | progressive |" in text  # tie on SLOs: lower P99 TTFT
    assert "| chat@8 | **progressive** | 60 % | 250 | full |" in text
    assert "| e | failed | RuntimeError: router exited |" in text
    names = ["ttft_cdf", "tpot_cdf", "slo_vs_rate", "p99_ttft_vs_rate", "replicas_timeline",
             "migration_vs_bytes"]
    for name in names:
        data = (out / "plots" / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, name
        assert f"plots/{name}.png" in text
    states = replica_states(next(r for r in load_results(out) if r.key == "d"))
    assert states["decode"] == [(0.0, 1), (2.0, 2)] and states["prefill"][-1] == (2.0, 1)


def test_the_report_shows_the_cells_of_the_last_matrix_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cell(out, "kept", "full", 2.0, 100.0, 1.0)
    cell(out, "old", "progressive", 2.0, 150.0, 1.0)  # a cell of an earlier version of the file
    (out / "matrix.json").write_text(json.dumps(["kept"]))
    assert [r.key for r in load_results(out)] == ["kept"]
