"""What the serving benchmark sends and when: Poisson arrivals, or a replayed public trace (pure).

Traces (see /work/shared/data/traces/README.md):
- Mooncake JSONL: ``{"timestamp": ms, "input_length", "output_length", ...}`` per line;
- Azure LLM inference 2023 CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens`` (absolute wall time).
Lengths are clipped to what the served model accepts (the trace's models had far longer contexts).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Arrival:
    """One request of the workload: when to send it (seconds from start) and its lengths."""

    at: float
    input_len: int
    output_len: int


def poisson_arrivals(num: int, rate: float, input_len: int, output_len: int, seed: int = 0) -> list[Arrival]:
    """`num` requests with exponential gaps of mean 1/rate (all at t=0 when rate is inf)."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for _ in range(num):
        arrivals.append(Arrival(at, input_len, output_len))
        if math.isfinite(rate):
            at += rng.expovariate(rate)
    return arrivals


def load_trace(path: Path, num: int, speed: float = 1.0) -> list[Arrival]:
    """The first `num` requests of a Mooncake JSONL or Azure CSV trace; times divided by `speed`."""
    rows = _mooncake(path, num) if path.suffix == ".jsonl" else _azure(path, num)
    if not rows:
        raise ValueError(f"no requests in trace {path}")
    first = rows[0][0]
    return [Arrival((t - first) / speed, i, o) for t, i, o in rows]


def clip(arrivals: list[Arrival], max_input: int, max_total: int) -> list[Arrival]:
    """Fit each request into the model's limits: input ≤ max_input, input + output ≤ max_total, both ≥ 1."""
    fitted = []
    for a in arrivals:
        input_len = max(1, min(a.input_len, max_input, max_total - 1))
        output_len = max(1, min(a.output_len, max_total - input_len))
        fitted.append(Arrival(a.at, input_len, output_len))
    return fitted


def _mooncake(path: Path, num: int) -> list[tuple[float, int, int]]:
    rows: list[tuple[float, int, int]] = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if len(rows) >= num:
                break
            if line.strip():
                item = json.loads(line)
                rows.append(
                    (item["timestamp"] / 1000.0, int(item["input_length"]), int(item["output_length"]))
                )
    return rows


def _azure(path: Path, num: int) -> list[tuple[float, int, int]]:
    rows: list[tuple[float, int, int]] = []
    with path.open(encoding="utf-8", newline="") as handle:
        for item in csv.DictReader(handle):
            if len(rows) >= num:
                break
            # 7 fractional digits: keep microseconds for datetime.
            stamp, _, frac = item["TIMESTAMP"].partition(".")
            when = datetime.datetime.fromisoformat(f"{stamp}.{frac[:6]:0<6}")
            rows.append((when.timestamp(), int(item["ContextTokens"]), int(item["GeneratedTokens"])))
    return rows
