"""What scaling cost and bought, from one cell's files (pure: records in, numbers out).

```
 timeline.jsonl  replica (joined in a state) + transition ─► replica_seconds (the cost), new replicas,
                                                            when the first of them started / was ready
                 transfer ──────────────────────────────► weight bytes moved, per method
 requests.jsonl  route.prefill_replica / decode_replica ─► first token a new replica served
```
Times: the timeline's `wall` (Unix seconds) against the load's start (`wall_start` of summary.json);
requests' `start`, `ttft`, `itl` are seconds from that start already.

A replica costs from the moment it leaves `inactive` (loading counts: it holds a GPU) until it is
`inactive` again or `dead`; idle replicas keeping their weights for the keep-alive cost too. A static
cluster's cost is its replicas × the load's duration.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster.bench.serving.stats import RequestRecord, attainment, percentile

FREE = frozenset({"inactive", "dead"})
"""States that hold no weights and cost nothing."""
SERVING = frozenset({"prefill", "decode", "colocated", "new_prefill", "refractory_prefill", "old_prefill"})
"""States in which a replica serves requests (a live new prefill replica serves while loading)."""

Record = dict[str, Any]


def _changes(timeline: Iterable[Record]) -> list[tuple[float, int, str]]:
    """(wall, replica, state) of every `replica` and `transition` record, in time order."""
    out = []
    for r in timeline:
        if r.get("kind") == "replica":
            out.append((float(r["wall"]), int(r["replica"]), str(r["state"])))
        elif r.get("kind") == "transition":
            out.append((float(r["wall"]), int(r["replica"]), str(r["target"])))
    return sorted(out, key=lambda c: c[0])


def state_spans(timeline: Iterable[Record], end: float) -> dict[int, list[tuple[float, float, str]]]:
    """replica → [(from, to, state)] (wall clock), the last span open until `end`."""
    spans: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    current: dict[int, tuple[float, str]] = {}
    for wall, replica, state in _changes(timeline):
        if replica in current:
            since, was = current[replica]
            spans[replica].append((since, wall, was))
        current[replica] = (wall, state)
    for replica, (since, state) in current.items():
        spans[replica].append((since, max(since, end), state))
    return dict(spans)


def replica_seconds(timeline: Iterable[Record], begin: float, end: float) -> float:
    """Seconds of replicas holding weights (any state but inactive and dead) within [begin, end]."""
    total = 0.0
    for spans in state_spans(timeline, end).values():
        for lo, hi, state in spans:
            if state not in FREE:
                total += max(0.0, min(hi, end) - max(lo, begin))
    return total


def new_replicas(timeline: Iterable[Record]) -> set[int]:
    """The replicas that joined the router inactive: the cluster's room to scale up."""
    return {int(r["replica"]) for r in timeline
            if r.get("kind") == "replica" and r.get("state") == "inactive"}


def every_replica(timeline: Iterable[Record]) -> set[int]:
    """Every replica that joined the router."""
    return {int(r["replica"]) for r in timeline if r.get("kind") == "replica"}


def first_change(timeline: Iterable[Record], replicas: set[int], states: Iterable[str], after: float
                 ) -> float | None:
    """Wall time of the first change of one of `replicas` into one of `states` at or after `after`."""
    wanted = set(states)
    times = [wall for wall, replica, state in _changes(timeline)
             if replica in replicas and state in wanted and wall >= after]
    return min(times, default=None)


def token_times(request: Record, replicas: set[int]) -> list[float]:
    """When (load clock) `replicas` gave this request a token: its first token if one of them
    prefilled it, its second if one of them decoded it."""
    route = request.get("route") or {}
    if not request.get("success"):
        return []
    first = float(request["start"]) + float(request["ttft"])
    times = []
    if route.get("prefill_replica") in replicas:
        times.append(first)
    if route.get("decode_replica") in replicas and request.get("itl"):
        times.append(first + float(request["itl"][0]))
    return times


def first_token_by(requests: Iterable[Record], replicas: set[int], after: float) -> float | None:
    """The earliest token (load clock, at or after `after`) that one of `replicas` served."""
    times = [t for q in requests for t in token_times(q, replicas) if t >= after]
    return min(times, default=None)


@dataclass(frozen=True)
class Moved:
    """Weight transfers of one method."""

    transfers: int = 0
    failed: int = 0
    bytes: int = 0  # of the transfers that completed
    seconds: float = 0.0  # summed over those transfers

    def to_json(self) -> dict[str, Any]:
        """As scaling.json writes it."""
        return {"transfers": self.transfers, "failed": self.failed, "bytes": self.bytes,
                "seconds": round(self.seconds, 3)}


def weights_moved(timeline: Iterable[Record]) -> dict[str, Moved]:
    """method → transfers, failures, bytes and seconds (the timeline's `transfer` records)."""
    moved: dict[str, Moved] = {}
    for r in timeline:
        if r.get("kind") != "transfer":
            continue
        was = moved.get(str(r.get("method")), Moved())
        ok = bool(r.get("ok"))
        moved[str(r.get("method"))] = Moved(
            was.transfers + 1, was.failed + (not ok), was.bytes + (int(r.get("bytes") or 0) if ok else 0),
            was.seconds + (float(r.get("seconds") or 0.0) if ok else 0.0))
    return moved


def kv_bytes(requests: Sequence[Record]) -> int:
    """KV bytes the routes of successful requests report moved (prefill → decode migrations)."""
    return sum(int((q.get("route") or {}).get("migration_bytes") or 0) for q in requests if q.get("success"))


def burst_window(phases: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(start, end) of the busiest phase, seconds from the load's start (the first, on a tie)."""
    busiest = max(range(len(phases)), key=lambda i: (phases[i][1], -i))
    start = sum(seconds for seconds, _ in phases[:busiest])
    return start, start + phases[busiest][0]


def arrived_within(requests: Iterable[Record], begin: float, end: float) -> list[Record]:
    """The requests the workload sent within [begin, end) (their `arrival`, load clock)."""
    return [q for q in requests if begin <= _sent(q) < end]


def _sent(q: Record) -> float:
    """When the workload sent a request: its scheduled `arrival`, else when it went out (`start`)."""
    arrival = q.get("arrival")
    return float(arrival if arrival is not None else q.get("start", 0.0))


def _record(q: Record) -> RequestRecord:
    return RequestRecord(index=int(q.get("index", 0)), input_len=int(q.get("input_len", 0)),
                         output_len=int(q.get("output_len", 0)), success=bool(q.get("success")),
                         start=float(q.get("start", 0.0)), ttft=float(q.get("ttft", 0.0)),
                         latency=float(q.get("e2el", 0.0)), itl=list(q.get("itl") or []))


def latency_figures(requests: Sequence[Record], slos: dict[str, float]) -> dict[str, Any]:
    """Of these requests: how many, P50/P90/P99 TTFT and TPOT (ms, None without samples) and SLO
    attainment (failed requests count as missing), by the serving benchmark's definitions."""
    records = [_record(q) for q in requests]
    done = [r for r in records if r.success]
    samples = {"ttft": [1000.0 * r.ttft for r in done],
               "tpot": [1000.0 * t for r in done if (t := r.tpot) is not None]}
    return {"requests": len(records), "completed": len(done),
            **{f"{metric}_ms": {f"p{q}": round(percentile(values, q), 1) if values else None
                                for q in (50, 90, 99)}
               for metric, values in samples.items()},
            "slo_attainment": attainment(records, slos)}


def cpu_seconds(resources: Iterable[Record], begin: float, end: float) -> float:
    """CPU seconds the cell's own processes (replicas, router) used between `begin` and `end` (load
    clock), from the sampler's cumulative `cpu_s` per process: the last sample inside the window
    minus the last one at or before its start (or the first inside it)."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for r in sorted((r for r in resources if r.get("kind") == "process"), key=lambda r: float(r["t"])):
        t, name, cpu = float(r["t"]), str(r["name"]), float(r["cpu_s"])
        if t <= begin or name not in first:
            first[name] = cpu
        if t <= end:
            last[name] = cpu
    return sum(max(0.0, last[name] - first[name]) for name in last)
