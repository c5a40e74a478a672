"""A workload spec, a seed and the served model's limits → the requests of one cell.

    poisson / gamma ─► synthetic(num, rate, CV, lengths | pairs of `lengths_from`)
    phases          ─► phased([(seconds, rate)], lengths | pairs, the first num)
    trace           ─► replay(rows in window, num, speed | rate)
                  both ─► clip(model positions, max_input_len, max_output_len)
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Sequence
from pathlib import Path

from pdcluster.bench.serving.sender import Served
from pdcluster.bench.serving.traces import TraceRow, read_trace
from pdcluster.bench.serving.workload import Arrival, Lengths, Phase, clip, phased, replay, synthetic
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
        inputs = Lengths(spec.input_len.low, spec.input_len.high)
        outputs = Lengths(spec.output_len.low, spec.output_len.high)
        if spec.arrival == "phases":
            raw = phased([Phase(s, r) for s, r in spec.phases], inputs, outputs, seed, spec.num, pairs)
        else:
            cv = spec.cv if spec.arrival == "gamma" else 1.0
            raw = synthetic(spec.num, spec.rate, cv, inputs, outputs, seed, pairs)
    max_input = min(served.max_input_tokens, spec.max_input_len or served.max_input_tokens)
    fitted = clip(raw, max_input, served.max_total_tokens, spec.max_output_len)
    return assign_models(fitted, spec.models, seed)


def assign_models(requests: list[Arrival], models: Sequence[str], seed: int) -> list[Arrival]:
    """Each request asks for one of `models` (none: unchanged). The traces name no model (BurstGPT's
    two, ChatGPT and GPT-4, are one service's), so the rule is the one serverless-LLM studies use: model
    popularity is Zipf-like (the k-th model drawn with weight 1 / k, ServerlessLLM's and BlitzScale's
    multi-model setups), each request drawn independently with the cell's seed: every model's load
    has the trace's bursts, scaled by its share."""
    if not models:
        return requests
    weights = [1.0 / (k + 1) for k in range(len(models))]
    rng = random.Random(f"models-{seed}")
    chosen = rng.choices(list(models), weights, k=len(requests))
    return [dataclasses.replace(a, model=m) for a, m in zip(requests, chosen, strict=True)]
