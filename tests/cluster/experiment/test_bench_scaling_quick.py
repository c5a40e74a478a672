"""`pdcluster bench scaling --quick` end to end on real processes: the generated experiment runs through
the harness (a spike of ~120 long prompts that outruns one prefill replica of the tiny model; `live`
on 1 prefill + 1 decode + 2 inactive replicas, and the static cluster provisioned for the peak), and
scaling.json holds each system's figures, the goals' ratios and a timeline figure per system. Checks
the path, not the speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster import SOURCE_ROOT

# a benchmark's own run (minutes): `make test-long`, which CI runs after the suite
pytestmark = pytest.mark.long

PNG = b"\x89PNG\r\n\x1a\n"


def test_quick_scaling_benchmark_scales_up_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "pdcluster", "bench", "scaling", "--quick", "--systems", "live", "static-peak",
         "--out", str(out), "--work", str(tmp_path / "work")],
        cwd=SOURCE_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| live |" in done.stdout and "| static-peak |" in done.stdout
    results = json.loads((out / "scaling.json").read_text())
    assert list(results["systems"]) == ["live", "static-peak"] and results["missing"] == []
    live, peak = results["systems"]["live"], results["systems"]["static-peak"]
    for figures in (live, peak):
        assert figures["completed"] == figures["requests"] > 0
        assert set(figures["ttft_ms"]) == {"p50", "p90", "p99"} and figures["ttft_ms"]["p99"] > 0
        assert (out / figures["timeline_png"]).read_bytes().startswith(PNG)
    # live started with 2 of its 4 replicas serving and scaled up over the emulated links
    assert live["weight_bytes"] > 0 and set(live["weight_transfers"]) <= {"p2p", "chain", "tanz"}
    assert live["requests_served_by_new_replicas"] > 0 and live["burst_to_new_replica_token_s"] is not None
    assert live["first_scale_up_at_s"] is not None
    # the spike's requests, a subset of the load's, all answered
    for figures in (live, peak):
        burst = figures["during_burst"]
        assert 0 < burst["requests"] == burst["completed"] < figures["requests"]
        assert burst["ttft_ms"]["p50"] is not None and set(burst["slo_attainment"]) == {"ttft", "tpot", "all"}
    assert 2 * live["duration_s"] < live["replica_seconds"] < 4 * live["duration_s"]
    # a static cluster costs its replicas times the load's duration, and never moves weights
    assert peak["replica_seconds"] == pytest.approx(4 * peak["duration_s"], rel=0.02)
    assert peak["weight_bytes"] == 0 and peak["burst_to_new_replica_token_s"] is None
    goals = {g["goal"]: g for g in results["goals"]}
    assert len(goals) == 3
    assert [g["met"] is None for g in results["goals"]] == [True, False, False]  # no stop-the-world cell
    cost = next(g for g in results["goals"] if g["metric"] == "replica_seconds")
    assert cost["ratio"] == pytest.approx(live["replica_seconds"] / peak["replica_seconds"], abs=1e-3)
    assert results["ratios"]["live"]["static-peak"]["replica_seconds"] == cost["ratio"]
    assert set(results["ratios"]) == {"live", "static-peak"} and results["ratios"]["static-peak"] == {}
    assert results["design"]["bandwidths_gbps"] == {"link": 0.05, "disk": 0.01, "host": 0.1}
    assert (out / "report.md").is_file() and (out / "scaling.toml").is_file()
