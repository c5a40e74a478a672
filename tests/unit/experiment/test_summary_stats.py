"""A cell's summary against values computed by hand (vLLM's definitions, pdcluster/bench/serving/stats.py)."""

from __future__ import annotations

import pytest

from pdcluster.bench.serving.stats import RequestRecord
from pdcluster.bench.serving.workload import Arrival
from pdcluster.experiment.summary import cell_summary

RECORDS = [
    RequestRecord(0, 10, 3, True, ttft=0.1, latency=0.6, itl=[0.2, 0.3],
                  route={"migration_bytes": 1000, "migration_seconds": 0.01}),
    RequestRecord(1, 20, 2, True, ttft=0.3, latency=0.4, itl=[0.1],
                  route={"migration_bytes": 3000, "migration_seconds": 0.03, "requeues": 1}),
    RequestRecord(2, 30, 1, True, ttft=0.5, latency=0.5),
    RequestRecord(3, 40, 0, False, error="HTTP 503"),
]
ARRIVALS = [Arrival(0.0, 10, 3), Arrival(0.5, 20, 2), Arrival(1.0, 30, 1), Arrival(1.5, 40, 1)]


@pytest.fixture
def summary() -> dict:
    return cell_summary(RECORDS, 2.0, {"ttft": 350.0, "tpot": 200.0}, ARRIVALS)


def test_latency_statistics(summary: dict) -> None:
    expected = {
        # TTFT 100, 300, 500 ms (the failed request has none)
        "mean_ttft_ms": 300.0, "median_ttft_ms": 300.0, "p50_ttft_ms": 300.0, "p90_ttft_ms": 460.0,
        "p95_ttft_ms": 480.0, "p99_ttft_ms": 496.0,
        # TPOT (E2EL - TTFT) / (out - 1): 250 and 100 ms; a one-token request has none
        "mean_tpot_ms": 175.0, "p99_tpot_ms": 248.5,
        # ITL: every gap, pooled
        "mean_itl_ms": 200.0, "median_itl_ms": 200.0, "p99_itl_ms": 298.0,
        # E2EL 600, 400, 500
        "mean_e2el_ms": 500.0, "p90_e2el_ms": 580.0,
    }
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value), key


def test_throughput_goodput_and_attainment(summary: dict) -> None:
    assert (summary["completed"], summary["failed"], summary["num_requests"]) == (3, 1, 4)
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(3.0)  # 6 tokens in 2 s
    assert summary["total_token_throughput"] == pytest.approx(33.0)  # (60 + 6) / 2
    # TTFT ≤ 350: requests 0, 1; TPOT ≤ 200: 1 and 2 (one token: TPOT 0, as in vLLM); both: 1 only
    assert summary["slo_attainment"] == pytest.approx({"ttft": 0.5, "tpot": 0.5, "all": 0.25})
    assert summary["request_goodput"] == pytest.approx(0.5)  # 1 request / 2 s
    assert summary["offered_rate"] == pytest.approx(2.0)  # 3 gaps in 1.5 s


def test_migration_figures_from_the_routes(summary: dict) -> None:
    assert summary["migration_bytes"] == 4000 and summary["migrated_requests"] == 2
    assert summary["mean_migration_ms"] == pytest.approx(20.0)
    assert summary["p99_migration_ms"] == pytest.approx(29.8)
    assert summary["retries"] == 1


def test_no_slos_no_goodput() -> None:
    summary = cell_summary(RECORDS, 2.0, {}, ARRIVALS)
    assert "request_goodput" not in summary and "slo_attainment" not in summary
