"""`pdcluster experiment run` end to end: a 2×2 matrix (two strategies × two rates) on the tiny model,
20 requests per cell, two nodes behind the fabric's paced NICs; then the same command again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdcluster import SOURCE_ROOT

PNG = b"\x89PNG\r\n\x1a\n"
FIGURES = ("ttft_cdf", "tpot_cdf", "slo_vs_rate", "p99_ttft_vs_rate", "replicas_timeline",
           "migration_vs_bytes")


def experiment(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "matrix.toml"
    path.write_text(f"""
name = "two by two"
strategies = ["full", "progressive"]
request_timeout = 120
[model]
path = "{model}"
num_blocks = 256
[slo]
ttft_ms = 5000
tpot_ms = 500
[[clusters]]
name = "1p1d"
[[workloads]]
name = "poisson"
rates = [4.0, 8.0]
num = 20
input_len = [16, 96]
output_len = 12
[[topologies]]
name = "paced"
[[topologies.nodes]]
name = "a"
replicas = ["prefill"]
nic_gbps = 2.0
[[topologies.nodes]]
name = "b"
replicas = ["decode"]
nic_gbps = 2.0
""")
    return path


def pdcluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdcluster", *args], cwd=SOURCE_ROOT, capture_output=True,
                          text=True, timeout=900)


def test_matrix_runs_every_cell_writes_the_report_and_resumes(tmp_path: Path, tiny_llama: Path) -> None:
    file, out = experiment(tmp_path, tiny_llama), tmp_path / "out"
    first = pdcluster("experiment", "run", str(file), "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    cells = sorted((out / "cells").iterdir())
    assert [c.name for c in cells] == [
        "1p1d.full.static@paced__poisson@4__r0", "1p1d.full.static@paced__poisson@8__r0",
        "1p1d.progressive.static@paced__poisson@4__r0", "1p1d.progressive.static@paced__poisson@8__r0"]
    for folder in cells:
        assert json.loads((folder / "status.json").read_text())["state"] == "done", folder
        lines = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
        assert len(lines) == 20 and all(q["success"] and q["output_len"] == 12 for q in lines)
        assert all(len(q["itl"]) == 11 and q["route"]["decode_replica"] == 1 for q in lines)
        assert all(q["route"]["migration_bytes"] > 0 for q in lines)
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["completed"] == 20 and set(summary["slo_attainment"]) == {"ttft", "tpot", "all"}
        samples = [json.loads(line) for line in (folder / "resources.jsonl").read_text().splitlines()]
        assert {s["kind"] for s in samples} >= {"process", "replica"}
        assert {s["name"] for s in samples if s["kind"] == "process"} == {
            "replica-0-prefill", "replica-1-decode", "router"}
        ranks = json.loads((folder / "ranks.json").read_text())["ranks"]
        assert [(r["node"], r["link_gbps"]) for r in ranks] == [("a", 2.0), ("b", 2.0)]
    report = (out / "report.md").read_text()
    assert "## Which system wins where" in report and "| poisson@8 |" in report
    for name in FIGURES:
        data = (out / "plots" / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, name
    stamps = {c.name: (c / "status.json").stat().st_mtime_ns for c in cells}

    again = pdcluster("experiment", "run", str(file), "--out", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 cells done, 0 failed, 0 skipped, 4 already finished" in again.stdout
    assert {c.name: (c / "status.json").stat().st_mtime_ns for c in cells} == stamps
