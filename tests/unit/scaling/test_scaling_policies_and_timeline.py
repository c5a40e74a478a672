"""Scaling policies by name, and the timeline's records."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from router.scaling import policies
from router.scaling.planner import Bounds, KindPlan, Plan
from router.scaling.timeline import Timeline, read
from router.states import State, Trigger
from router.weights import Method


def test_the_five_policies_are_registered_in_order() -> None:
    assert policies.names() == ("static", "multicast", "live", "stop-the-world", "host-cache")
    assert not policies.get("static").plans
    assert policies.get("live").caps.live and not policies.get("multicast").caps.live
    assert policies.get("stop-the-world").caps.methods == (Method.LOAD_DISK,)
    assert policies.get("host-cache").caps.methods == (Method.LOAD_HOST,)


def test_an_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown scaling policy 'fast'.*static, multicast, live"):
        policies.get("fast")


def test_a_name_registered_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        policies.register(policies.STATIC)


def test_timeline_records_are_json_lines_with_monotonic_times(tmp_path: Path) -> None:
    ticks = itertools.count(100.0, 0.5)
    timeline = Timeline(tmp_path / "run" / "timeline.jsonl", clock=lambda: next(ticks))
    p = Plan(KindPlan(1, 2, 3, 1), KindPlan(1, 1, 1, 0), loads={"prefill_backlog_s": 0.7})
    timeline.write("plan", prefill=p.prefill, decode=p.decode, loads=p.loads, bounds=Bounds())
    timeline.write("transition", replica=2, source=State.INACTIVE, target=State.LOADING_PREFILL,
                   trigger=Trigger.LOAD_PREFILL)
    timeline.write("transfer", method=Method.CHAIN, sources=(0,), targets=frozenset({2}), bytes=10, ok=True)
    timeline.close()
    records = read(tmp_path / "run" / "timeline.jsonl")
    assert [r["kind"] for r in records] == ["plan", "transition", "transfer"]
    assert [r["t"] for r in records] == [0.5, 1.0, 1.5]
    assert records[0]["prefill"] == {"current": 1, "low": 2, "high": 3, "delta": 1}
    assert records[1]["target"] == "loading_prefill" and records[1]["trigger"] == "load_prefill"
    assert records[2]["method"] == "chain" and records[2]["targets"] == [2]


def test_no_path_writes_nothing_and_a_broken_file_does_not_raise(tmp_path: Path) -> None:
    off = Timeline(None)
    assert not off.enabled
    off.write("plan")
    timeline = Timeline(tmp_path / "t.jsonl")
    timeline.write("plan")
    timeline._file.close()  # type: ignore[union-attr]  # writes fail from now on
    timeline.write("plan")  # logged once, never raised into the router
    assert not timeline.enabled and timeline.records == 1
