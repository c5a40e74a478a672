"""Per-request serving measurements and their summary, named as vLLM's `bench serve` names them (pure).

    RequestRecord (one per request) ──summarize()──► {"request_throughput", "mean_ttft_ms", "p99_itl_ms",
                                                      "request_goodput", ...}

TTFT = first token − send; TPOT = (E2EL − TTFT) / (output tokens − 1), over requests with at least two
output tokens; ITL = gaps between streamed tokens; E2EL = last byte − send (vLLM's `benchmark_serving`
definitions). Goodput = requests meeting every given SLO (in ms) per second of the run; a request with
one output token has TPOT 0 for that check, as in vLLM. SLO attainment = the fraction of all requests
(failed ones count as missing) meeting one SLO, or all of them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds from the benchmark start)."""

    index: int
    input_len: int
    output_len: int = 0
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    route: dict[str, Any] | None = None
    scheduled: float = 0.0  # when the workload said to send it (`start` is when it was sent)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    def to_json(self) -> dict[str, Any]:
        """The JSONL line of this request."""
        data = asdict(self)
        data["tpot"] = self.tpot
        return data


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` → {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"SLO {item!r} must look like ttft:MS, tpot:MS or e2el:MS")
        slos[name] = float(value)
        if not slos[name] > 0:
            raise ValueError(f"SLO {item!r} must be positive")
    return slos


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    """True when the request succeeded within every SLO."""
    if not record.success:
        return False
    observed = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.latency}
    return all(observed[name] * 1000.0 <= limit for name, limit in slos.items())


def attainment(records: Sequence[RequestRecord], slos: dict[str, float]) -> dict[str, float]:
    """Fraction of all requests meeting each SLO alone, and all of them (`all`); {} without SLOs."""
    if not slos or not records:
        return {}
    shares = {name: sum(meets(r, {name: limit}) for r in records) / len(records)
              for name, limit in slos.items()}
    shares["all"] = sum(meets(r, slos) for r in records) / len(records)
    return shares


def _samples(records: Sequence[RequestRecord], metric: str) -> list[float]:
    done = [r for r in records if r.success]
    if metric == "itl":
        return [gap for r in done for gap in r.itl]
    if metric == "tpot":
        return [t for r in done if (t := r.tpot) is not None]
    return [getattr(r, "ttft" if metric == "ttft" else "latency") for r in done]


def summarize(records: Sequence[RequestRecord], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    """vLLM-named summary of a run that took `duration` seconds."""
    done = [r for r in records if r.success]
    total_in = sum(r.input_len for r in done)
    total_out = sum(r.output_len for r in done)
    span = max(duration, 1e-9)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / span,
        "output_throughput": total_out / span,
        "total_token_throughput": (total_in + total_out) / span,
    }
    if slos:
        summary["request_goodput"] = sum(meets(r, slos) for r in records) / span
        summary["slos_ms"] = dict(slos)
        summary["slo_attainment"] = attainment(records, slos)
    summary.update(prefix_summary(done))
    for metric in METRICS:
        values_ms = [v * 1000.0 for v in _samples(records, metric)]
        summary[f"mean_{metric}_ms"] = statistics.fmean(values_ms) if values_ms else 0.0
        summary[f"median_{metric}_ms"] = statistics.median(values_ms) if values_ms else 0.0
        summary[f"std_{metric}_ms"] = statistics.pstdev(values_ms) if values_ms else 0.0
        for q in PERCENTILES:
            summary[f"p{q:g}_{metric}_ms"] = percentile(values_ms, q)
    return summary


def prefix_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """What the prefix cache saved, from the routes pdcluster reports (a server without them: none
    cached): prompt tokens found cached, the hit rate, prompt tokens computed, KV bytes migrated."""
    prompt = sum(r.input_len for r in records)
    cached = sum(int((r.route or {}).get("cached_tokens") or 0) for r in records)
    return {
        "cached_prompt_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "prefill_tokens_computed": prompt - cached,
        "kv_bytes_migrated": sum(int((r.route or {}).get("migration_bytes") or 0) for r in records),
    }


def cluster_decode_rate(records: Sequence[RequestRecord]) -> float:
    """Decode tokens/s the cluster sustained: tokens after each first token ÷ the decode phase's span.

    The span runs from the earliest first token to the last finish; with all requests sent at once
    (rate inf) this is the decode phase of one batch, the same thing the in-process run measures.
    """
    done = [r for r in records if r.success and r.output_len > 1]
    if not done:
        return 0.0
    tokens = sum(r.output_len - 1 for r in done)
    begin = min(r.start + r.ttft for r in done)
    end = max(r.start + r.latency for r in done)
    return tokens / max(end - begin, 1e-9)


@dataclass(frozen=True)
class SteadyDecode:
    """The cluster's decode while every request of a burst is decoding (see `steady_decode_rate`)."""

    tokens_per_s: float
    seconds: float  # length of the window (0: no request's decode overlapped every other's)
    tokens: int


def steady_decode_rate(records: Sequence[RequestRecord]) -> SteadyDecode:
    """Decode tokens/s from the last request's first decoded token (its second token) to the first
    finish: the window in which every request is in a decode batch and none has finished, so the
    cluster decodes all of them at once — the batch size the in-process run decodes. Tokens are
    counted by their arrival times (`start + ttft + cumulative itl`). `cluster_decode_rate` also
    counts the ramp (later batches' prefills and migrations while earlier ones decode) and the tail.
    """
    done = [r for r in records if r.success and r.output_len > 1 and r.itl]
    if not done:
        return SteadyDecode(0.0, 0.0, 0)
    begin = max(r.start + r.ttft + r.itl[0] for r in done)
    end = min(r.start + r.latency for r in done)
    if end <= begin:
        return SteadyDecode(0.0, 0.0, 0)
    tokens = 0
    for r in done:
        arrival = r.start + r.ttft
        for gap in r.itl:
            arrival += gap
            tokens += begin < arrival <= end
    return SteadyDecode(tokens / (end - begin), end - begin, tokens)


def mean_concurrency(records: Sequence[RequestRecord], duration: float) -> float:
    """Average number of requests in flight (Little's law: Σ latency ÷ duration)."""
    return sum(r.latency for r in records if r.success) / max(duration, 1e-9)
