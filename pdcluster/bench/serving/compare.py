"""Several runs of one workload on fresh local clusters, side by side: `--compare-prefix-cache`
and `--compare-long-prompt` (bench.py) run their variants through here."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")  # a benchmark config dataclass with a `json` path field


def run_variants(config: C, variants: Mapping[str, Mapping[str, Any]], measure: Callable[[C], dict[str, Any]],
                 json_path: Path | None) -> dict[str, dict[str, Any]]:
    """Each variant's run (`config` with the variant's fields replaced, its own JSON beside
    `json_path`), one after the other; name -> summary."""
    runs: dict[str, dict[str, Any]] = {}
    for name, fields in variants.items():
        out = json_path.with_name(f"{json_path.stem}.{name}.json") if json_path else None
        described = ", ".join(f"{k}={v}" for k, v in fields.items())
        print(f"bench serving: run {name} ({described})", file=sys.stderr, flush=True)
        runs[name] = measure(replace(config, json=out, **fields))  # type: ignore[type-var]
    return runs


def report(title: str, runs: dict[str, dict[str, Any]], keys: Sequence[str], ratios: dict[str, float],
           json_path: Path | None) -> int:
    """Write `{"runs": ..., **ratios}` to `json_path`, print the table and the ratios; the exit
    status (0: no run failed a request)."""
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        summary = {"runs": runs, **ratios}
        json_path.write_text(json.dumps(summary, indent=2, default=str, allow_nan=False) + "\n")
    width = max(14, *(len(n) + 2 for n in runs))
    print("=" * 20, title, "=" * 20)
    print(f"{'':<26}" + "".join(f"{n:>{width}}" for n in runs))
    for key in keys:
        cells = [runs[n].get(key, 0) for n in runs]
        row = (f"{v:>{width}.3f}" if isinstance(v, float) else f"{v:>{width}}" for v in cells)
        print(f"{key:<26}" + "".join(row))
    for key, value in ratios.items():
        print(f"{key:<44} {value:.3f}")
    return 0 if all(r["failed"] == 0 for r in runs.values()) else 1
