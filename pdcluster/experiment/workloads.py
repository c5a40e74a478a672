"""A workload spec, a seed and the served model's limits → the requests of one cell.

    poisson / gamma ─► synthetic(num, rate, CV, lengths | pairs of `lengths_from`)
    trace           ─► replay(rows in window, num, speed | rate)
                  both ─► clip(model positions, max_input_len, max_output_len)
"""

from __future__ import annotations

import functools
from pathlib import Path

from pdcluster.bench.serving.sender import Served
from pdcluster.bench.serving.traces import TraceRow, read_trace
from pdcluster.bench.serving.workload import Arrival, Lengths, clip, replay, synthetic
from pdcluster.experiment.spec import WorkloadSpec


@functools.lru_cache(maxsize=8)
def _rows(path: Path, fmt: str) -> tuple[TraceRow, ...]:
    """A trace's rows, read once per run (every cell of a rate sweep replays the same file)."""
    return tuple(read_trace(path, fmt))


def arrivals(spec: WorkloadSpec, seed: int, served: Served) -> list[Arrival]:
    """The requests of `spec` for `seed`, fitted to what the server accepts."""
    if spec.arrival == "trace":
        assert spec.trace is not None
        rate = spec.rate if spec.rate != float("inf") else 0.0
        raw = replay(_rows(spec.trace, spec.format), spec.num, spec.window, spec.speed, rate)
        if spec.rate == float("inf"):
            raw = [Arrival(0.0, a.input_len, a.output_len, a.hash_ids) for a in raw]
    else:
        pairs = _rows(spec.lengths_from, spec.format) if spec.lengths_from else ()
        cv = spec.cv if spec.arrival == "gamma" else 1.0
        raw = synthetic(spec.num, spec.rate, cv, Lengths(spec.input_len.low, spec.input_len.high),
                        Lengths(spec.output_len.low, spec.output_len.high), seed, pairs)
    max_input = min(served.max_input_tokens, spec.max_input_len or served.max_input_tokens)
    return clip(raw, max_input, served.max_total_tokens, spec.max_output_len)
