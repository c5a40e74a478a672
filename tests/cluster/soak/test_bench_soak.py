"""`pdcluster bench soak` for one minute: mixed traffic, strategy flips, a drain and restore, one
replica killed and restarted with the same rank; it passes, samples every process (the replicas'
gRPC front children too), and writes its JSON and PNG."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pdcluster.bench.soak.bench import BenchSoakConfig, run

# a benchmark's own run (minutes): `make test-long`, which CI runs after the suite
pytestmark = pytest.mark.long


@pytest.mark.timeout(240)
def test_one_minute_soak_passes(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    config = BenchSoakConfig(model=tiny_model_factory(), minutes=1.0, clients=4, sample_every=3.0,
                             kill_every=40.0, down_for=2.0, drain_every=25.0, json=tmp_path / "soak.json",
                             log_dir=tmp_path / "logs")
    code = run(config)
    report = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0, report["problems"]
    assert report["passed"] and report["problems"] == []
    assert len(report["kills"]) == 1 and report["kills"][0]["back_s"] is not None
    assert report["requests"]["finished"] > 0 and report["requests"]["refused"] > 0
    assert report["admin_calls"]["SetMigrationStrategy OK"] > 0
    sampled = {row["process"] for row in report["samples"]["usage"]}
    assert {"router", "replica-0-prefill", "replica-0-prefill/child-0", "replica-2-decode"} <= sampled
    pids = {row["pid"] for row in report["samples"]["usage"] if row["process"] == "replica-2-decode"}
    assert len(pids) == 2  # the killed life and the restarted one
    assert all(v is not None and v[0] == v[1] for v in report["pages_after"].values())
    judged = {(t["process"], t["metric"]) for t in report["trends"] if t["judged"]}
    assert ("router", "rss_mib") in judged and ("replica-1-decode", "fds") in judged
    assert Path(report["plot"]).stat().st_size > 10_000
