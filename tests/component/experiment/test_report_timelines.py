"""The report's replica timelines: every replica counted from the state it joined in (the timeline's
`replica` records), not only those that changed state; one figure per cell beside the combined one."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.experiment.plots import replica_states
from pdcluster.experiment.report import write_report
from pdcluster.experiment.results import load_results

PNG = b"\x89PNG\r\n\x1a\n"


def cell(out: Path, key: str, policy: str, records: list[dict[str, object]]) -> None:
    folder = out / "cells" / key
    folder.mkdir(parents=True)
    (folder / "cell.json").write_text(json.dumps({
        "system": f"burst/full/{policy}@local", "strategy": "full", "policy": policy, "rep": 0,
        "cluster": {"name": "burst"}, "topology": {"name": "local"}, "endpoint": None,
        "workload": {"name": "burst", "rate": 1.0}}))
    (folder / "status.json").write_text(json.dumps({"state": "done"}))
    (folder / "summary.json").write_text(json.dumps({"completed": 2, "num_requests": 2, "wall_start": 100.0}))
    (folder / "requests.jsonl").write_text("".join(
        json.dumps({"success": True, "start": s, "ttft": 0.1, "tpot": 0.01, "route": {}}) + "\n"
        for s in (0.5, 4.5)))
    (folder / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def joined(replica: int, state: str) -> dict[str, object]:
    return {"kind": "replica", "wall": 95.0 + replica * 0.01, "replica": replica, "state": state}


def test_replicas_that_never_change_are_counted_in_the_state_they_joined(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cell(out, "static", "static", [joined(0, "prefill"), joined(1, "decode"), joined(2, "inactive")])
    cell(out, "live", "live", [
        joined(0, "prefill"), joined(1, "decode"), joined(2, "inactive"),
        {"kind": "transition", "wall": 102.0, "replica": 2, "source": "inactive", "target": "new_prefill"},
        {"kind": "transition", "wall": 103.0, "replica": 2, "source": "new_prefill", "target": "prefill"}])
    results = {r.key: r for r in load_results(out)}
    static = replica_states(results["static"])
    assert {state: points[-1][1] for state, points in static.items()} == {
        "prefill": 1, "decode": 1, "inactive": 1}
    live = replica_states(results["live"])
    assert live["prefill"][-1] == (3.0, 2) and live["inactive"][-1] == (3.0, 0)
    assert live["new_prefill"][-2:] == [(2.0, 1), (3.0, 0)]

    report = write_report(out).read_text()
    for key in ("static", "live"):
        figure = out / "plots" / "timelines" / f"{key}.png"
        assert figure.read_bytes().startswith(PNG) and f"(plots/timelines/{key}.png)" in report
