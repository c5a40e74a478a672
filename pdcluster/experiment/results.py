"""The cells of an experiment folder as the report reads them (from disk only, so a report can be
rebuilt at any time, also from a run that was interrupted)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a crash
                    continue
    return rows


def _keys(path: Path) -> list[str]:
    try:
        return [str(k) for k in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return []


def _json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


@dataclass
class CellResult:
    """One cell folder: its description, status, summary and (read on demand) its record files."""

    folder: Path
    cell: dict[str, Any]
    status: dict[str, Any]
    summary: dict[str, Any]
    label: str = ""
    _cache: dict[str, list[dict[str, Any]]] = field(default_factory=dict, repr=False)

    @property
    def key(self) -> str:
        """The folder name."""
        return self.folder.name

    @property
    def state(self) -> str:
        """done, failed, skipped, or incomplete (no status: interrupted)."""
        return str(self.status.get("state", "incomplete"))

    @property
    def system(self) -> str:
        """The measured system (cluster/strategy/policy@topology, or the endpoint's name)."""
        return str(self.cell.get("system", self.key))

    @property
    def workload(self) -> str:
        """The workload's name (with its rate in a sweep)."""
        return str(self.cell.get("workload", {}).get("name", "?"))

    @property
    def family(self) -> str:
        """The workload without its rate."""
        return self.workload.partition("@")[0]

    @property
    def rate(self) -> float:
        """The workload's requests/s: the spec's, else the offered one (inf: all at once)."""
        value = self.cell.get("workload", {}).get("rate", "inf")
        rate = math.inf if value == "inf" else float(value)
        if rate == 0 or math.isinf(rate):
            offered = self.summary.get("offered_rate", "inf")
            return math.inf if offered == "inf" else float(offered)
        return rate

    @property
    def rep(self) -> int:
        """The repetition index."""
        return int(self.cell.get("rep", 0))

    def part(self, name: str) -> str:
        """A part of the system: cluster, strategy, policy, topology or endpoint name ("" if none)."""
        value = self.cell.get(name)
        if isinstance(value, dict):
            return str(value.get("name", ""))
        return str(value or "")

    def requests(self) -> list[dict[str, Any]]:
        """The per-request lines."""
        return self._read("requests.jsonl")

    def resources(self) -> list[dict[str, Any]]:
        """The resource samples."""
        return self._read("resources.jsonl")

    def timeline(self) -> list[dict[str, Any]]:
        """The router's timeline records."""
        return self._read("timeline.jsonl")

    def _read(self, name: str) -> list[dict[str, Any]]:
        if name not in self._cache:
            self._cache[name] = _lines(self.folder / name)
        return self._cache[name]


MATRIX = "matrix.json"


def load_results(out: Path) -> list[CellResult]:
    """The cell folders under `out/cells` of the last run's matrix (all of them without its
    `matrix.json`), each labelled by the parts that vary across the experiment."""
    folders = sorted(p for p in (out / "cells").glob("*") if p.is_dir()) if (out / "cells").is_dir() else []
    current = set(_keys(out / MATRIX))
    if current:
        folders = [f for f in folders if f.name in current]
    results = [CellResult(f, _json(f / "cell.json"), _json(f / "status.json"), _json(f / "summary.json"))
               for f in folders]
    _label(results)
    return results


def _label(results: list[CellResult]) -> None:
    """Legend labels: the parts of the system that differ between cells (the strategy at least)."""
    parts = ("cluster", "strategy", "policy", "topology")
    local = [r for r in results if r.cell and not r.part("endpoint")]
    varying = [p for p in parts if len({r.part(p) for r in local}) > 1] or ["strategy"]
    for r in results:
        endpoint = r.part("endpoint")
        r.label = endpoint or "/".join(r.part(p) for p in varying)
