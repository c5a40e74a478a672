"""`pdcluster bench scaling`'s arithmetic on hand-made records: replica-seconds from a timeline, the
first token of a replica that started inactive, weight bytes per method, the goals; and the
experiment file it generates, read back by the harness."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdcluster.experiment.load import load_experiment
from pdcluster.experiment.matrix import expand
from pdcluster.experiment.scaling import metrics
from pdcluster.experiment.scaling.design import (
    PEAK,
    SYSTEMS,
    Bandwidths,
    Design,
    Reference,
    burst_start,
    experiment_toml,
)
from pdcluster.experiment.scaling.figures import goals, ratios

T0 = 1000.0  # the load's start, wall clock


def joined(replica: int, state: str, wall: float = T0 - 5) -> dict[str, Any]:
    return {"kind": "replica", "wall": wall, "replica": replica, "state": state}


def moved(replica: int, source: str, target: str, at: float) -> dict[str, Any]:
    return {"kind": "transition", "wall": T0 + at, "replica": replica, "source": source, "target": target}


# 1 prefill + 1 decode serve throughout; replica 2 loads at 10 s, serves 11..30 s, idles to 35 s, then
# is reset; replica 3 loads at 10 s and fails (dead at 12 s); the load lasts 60 s
TIMELINE = [
    joined(0, "prefill"), joined(1, "decode"), joined(2, "inactive"), joined(3, "inactive"),
    moved(2, "inactive", "loading_prefill", 10.0), moved(3, "inactive", "loading_decode", 10.0),
    moved(2, "loading_prefill", "prefill", 11.0), moved(3, "loading_decode", "dead", 12.0),
    moved(2, "prefill", "draining_prefill", 30.0), moved(2, "draining_prefill", "idle", 31.0),
    moved(2, "idle", "inactive", 35.0),
    {"kind": "transfer", "method": "chain", "ok": True, "bytes": 400, "seconds": 1.0},
    {"kind": "transfer", "method": "chain", "ok": False, "bytes": 400, "seconds": 2.0},
    {"kind": "transfer", "method": "load_disk", "ok": True, "bytes": 200, "seconds": 7.0},
    {"kind": "plan", "wall": T0 + 1},
]


def test_replica_seconds_count_every_state_that_holds_weights_inside_the_load() -> None:
    # 2 × 60 s, replica 2 from 10 s to 35 s (loading, serving, draining, idle), replica 3 loading 2 s
    assert metrics.replica_seconds(TIMELINE, T0, T0 + 60) == pytest.approx(120 + 25 + 2)
    # only the window counts: from 20 s to 60 s
    assert metrics.replica_seconds(TIMELINE, T0 + 20, T0 + 60) == pytest.approx(80 + 15)
    static = [joined(r, "prefill" if r < 2 else "decode") for r in range(4)]
    assert metrics.replica_seconds(static, T0, T0 + 60) == pytest.approx(240)


def test_new_replicas_and_when_they_changed() -> None:
    new = metrics.new_replicas(TIMELINE)
    assert new == {2, 3}
    assert metrics.first_change(TIMELINE, new, {"loading_prefill", "loading_decode"}, T0) == T0 + 10
    assert metrics.first_change(TIMELINE, new, metrics.SERVING, T0) == T0 + 11
    assert metrics.first_change(TIMELINE, new, metrics.SERVING, T0 + 12) is None


def request(start: float, ttft: float, prefill: int, decode: int, itl: float = 0.1) -> dict[str, Any]:
    return {"success": True, "start": start, "ttft": ttft, "itl": [itl, itl],
            "route": {"prefill_replica": prefill, "decode_replica": decode, "migration_bytes": 10}}


def test_the_first_token_a_new_replica_served() -> None:
    requests = [request(5.0, 0.5, 0, 1), request(12.0, 1.0, 2, 1), request(11.0, 0.5, 0, 3, itl=0.2),
                {"success": False, "start": 11.0, "ttft": 0.0, "itl": [], "route": None}]
    # prefilled by new replica 2: its first token at 13.0; decoded by new replica 3: its second at 11.7
    assert metrics.first_token_by(requests, {2, 3}, after=10.0) == pytest.approx(11.7)
    assert metrics.first_token_by(requests, {2}, after=10.0) == pytest.approx(13.0)
    assert metrics.first_token_by(requests, {2, 3}, after=14.0) is None
    assert metrics.kv_bytes(requests) == 30


def test_weight_bytes_per_method_count_completed_transfers() -> None:
    got = metrics.weights_moved(TIMELINE)
    assert got["chain"] == metrics.Moved(transfers=2, failed=1, bytes=400, seconds=1.0)
    assert got["load_disk"] == metrics.Moved(transfers=1, failed=0, bytes=200, seconds=7.0)


def test_goals_are_ratios_to_baselines_of_the_same_run() -> None:
    figures = {"live": {"ttft_ms": {"p99": 300.0}, "replica_seconds": 150.0},
               "stop-the-world": {"ttft_ms": {"p99": 2000.0}, "replica_seconds": 160.0},
               PEAK: {"ttft_ms": {"p99": 250.0}, "replica_seconds": 240.0}}
    got = goals(figures)
    assert [(g["ratio"], g["met"]) for g in got] == [(0.15, True), (1.2, True), (0.625, False)]
    missing = goals({"live": figures["live"]})
    assert all(g["ratio"] is None and g["met"] is None for g in missing)


def timed(arrival: float, ttft: float, e2el: float, output_len: int = 5, ok: bool = True) -> dict[str, Any]:
    return {"index": 0, "input_len": 8, "output_len": output_len, "success": ok, "arrival": arrival,
            "start": arrival, "ttft": ttft, "e2el": e2el, "itl": []}


def test_latencies_of_the_requests_sent_during_the_burst() -> None:
    phases = ((30.0, 0.4), (20.0, 2.0), (60.0, 0.4))
    assert metrics.burst_window(phases) == (30.0, 50.0)
    assert metrics.burst_window(((5.0, 1.0), (5.0, 3.0), (5.0, 3.0))) == (5.0, 10.0)  # the first on a tie
    requests = [timed(10.0, 0.1, 0.5), timed(30.0, 1.0, 2.0), timed(40.0, 3.0, 3.4), timed(49.9, 2.0, 6.0),
                timed(45.0, 0.0, 0.0, ok=False), timed(50.0, 0.1, 0.2)]
    burst = metrics.arrived_within(requests, *metrics.burst_window(phases))
    assert [q["arrival"] for q in burst] == [30.0, 40.0, 49.9, 45.0]
    # the schedule decides, not when the request went out (a late send of a quiet-phase request)
    late = {**timed(29.0, 1.0, 2.0), "start": 31.0}
    assert metrics.arrived_within([late, timed(0.0, 1.0, 2.0)], 0.0, 30.0) == [late, timed(0.0, 1.0, 2.0)]
    got = metrics.latency_figures(burst, {"ttft": 2500.0, "tpot": 500.0})
    assert (got["requests"], got["completed"]) == (4, 3)
    # TTFTs 1000, 3000, 2000 ms; TPOTs (E2EL - TTFT) / 4: 250, 100, 1000 ms
    assert got["ttft_ms"] == {"p50": 2000.0, "p90": 2800.0, "p99": 2980.0}
    assert got["tpot_ms"]["p50"] == 250.0
    # within both: the first only; the failed request counts as missing
    assert got["slo_attainment"] == {"ttft": 0.5, "tpot": 0.5, "all": 0.25}
    empty = metrics.latency_figures([], {"ttft": 1.0})
    assert empty["ttft_ms"] == {"p50": None, "p90": None, "p99": None} and empty["slo_attainment"] == {}


def test_ratios_against_every_baseline_that_ran() -> None:
    def f(p99: float, burst_p99: float | None, cost: float) -> dict[str, Any]:
        return {"ttft_ms": {"p99": p99}, "replica_seconds": cost,
                "during_burst": {"ttft_ms": {"p99": burst_p99}, "tpot_ms": {"p99": 100.0}}}

    got = ratios({"live": f(300.0, 600.0, 150.0), "static": f(600.0, 1200.0, 100.0),
                  PEAK: f(200.0, None, 250.0)})
    assert set(got) == {"live", "static", PEAK}
    assert got["live"]["static"] == {"ttft_ms.p99": 0.5, "during_burst.ttft_ms.p99": 0.5,
                                     "during_burst.tpot_ms.p99": 1.0, "replica_seconds": 1.5}
    assert got["live"][PEAK]["ttft_ms.p99"] == 1.5 and got["live"][PEAK]["during_burst.ttft_ms.p99"] is None
    assert "stop-the-world" not in got["live"] and PEAK not in got[PEAK] and "static" not in got["static"]


def test_cpu_seconds_of_the_cells_own_processes_within_the_load() -> None:
    def sample(t: float, name: str, cpu: float) -> dict[str, Any]:
        return {"t": t, "kind": "process", "name": name, "cpu_s": cpu}

    resources = [sample(0.0, "router", 2.0), sample(0.0, "replica-0", 10.0), {"t": 0.5, "kind": "replica"},
                 sample(5.0, "router", 3.0), sample(5.0, "replica-0", 14.0), sample(11.0, "replica-0", 20.0),
                 sample(8.0, "replica-1", 1.0), sample(9.0, "replica-1", 1.5)]  # joined late
    # the whole load (0..10 s): router 1, replica-0 4 (its sample at 11 s is after the end), replica-1 0.5
    assert metrics.cpu_seconds(resources, 0.0, 10.0) == pytest.approx(5.5)
    assert metrics.cpu_seconds(resources, 5.0, 12.0) == pytest.approx(0.0 + 6.0 + 0.5)
    assert metrics.cpu_seconds([], 0.0, 10.0) == 0.0


def test_bandwidths_keep_the_reference_clusters_load_times() -> None:
    b = Bandwidths.scaled(200_000_000)  # a 200 MB checkpoint: 1/70 of a 7 B model's 14 GB
    assert (b.link_gbps, b.disk_gbps, b.host_gbps) == pytest.approx((1.4286, 0.2286, 2.8571), abs=1e-4)
    assert 200e6 * 8 / (b.disk_gbps * 1e9) == pytest.approx(Reference().seconds(16.0), rel=1e-3)  # 7 s
    assert burst_start(((30.0, 0.4), (30.0, 2.0), (60.0, 0.4))) == 30.0


def design(tmp_path: Path, **more: Any) -> Design:
    return Design(model=tmp_path / "m", tiny={"layers": 2, "hidden": 64}, inactive=3,
                  phases=((5.0, 1.0), (5.0, 4.0)), input_len=(8, 16), output_len=(4, 4),
                  bandwidths=Bandwidths(1.0, 0.5, 2.0), slo_ttft_ms=900, slo_tpot_ms=90,
                  router_args=("--heartbeat-timeout", "30"), **more)


def test_the_generated_experiment_has_a_cell_per_system(tmp_path: Path) -> None:
    path = tmp_path / "scaling.toml"
    path.write_text(experiment_toml(design(tmp_path)))
    experiment = load_experiment(path)
    cells = {c.key: c for c in expand(experiment)}
    assert sorted(cells) == sorted([
        "burst.full.static@nics__burst__r0", "burst.full.multicast@nics__burst__r0",
        "burst.full.live@nics__burst__r0", "burst.full.stop-the-world@nics__burst__r0",
        "burst-host-cache.full.host-cache@nics__burst__r0", "peak.full.static@nics__burst__r0"])
    live = cells["burst.full.live@nics__burst__r0"]
    assert live.cluster is not None and live.cluster.roles() == ["prefill", "decode"] + ["inactive"] * 3
    assert live.cluster.router_args == ("--max-prefill", "3", "--max-decode", "2", "--keep-alive", "5",
                                        "--cooldown", "5", "--ttft-slo", "0.9", "--tpot-slo", "0.09",
                                        "--heartbeat-timeout", "30")
    assert live.cluster.replica_args == ("--disk-gbps", "0.5", "--host-gbps", "2")
    host = cells["burst-host-cache.full.host-cache@nics__burst__r0"].cluster
    assert host is not None and host.replica_args[-1] == "--host-cache"
    peak = cells["peak.full.static@nics__burst__r0"].cluster
    assert peak is not None and (peak.prefill, peak.decode, peak.inactive) == (3, 2, 0)
    assert peak.router_args == ("--heartbeat-timeout", "30")
    assert [n.nic_gbps for n in live.topology.nodes] == [1.0] * 5
    assert live.workload.phases == ((5.0, 1.0), (5.0, 4.0)) and experiment.slo.limits() == {
        "ttft": 900.0, "tpot": 90.0}


def test_a_subset_of_systems_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "scaling.toml"
    path.write_text(experiment_toml(design(tmp_path, systems=("live", PEAK))))
    assert [c.key for c in expand(load_experiment(path))] == [
        "burst.full.live@nics__burst__r0", "peak.full.static@nics__burst__r0"]
    with pytest.raises(ValueError, match="unknown systems"):
        design(tmp_path, systems=("elastic",))
    assert set(SYSTEMS) == {"static", "multicast", "live", "stop-the-world", "host-cache", PEAK}
