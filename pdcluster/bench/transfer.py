"""`pdcluster bench transfer`: our transfer layer against raw-socket and gloo ceilings, same run.

Starts one process per rank on loopback for each measurement: our TCP fabric running the chosen
collective, a minimal raw-socket program (p2p, or a store-and-forward relay chain), and
torch.distributed gloo (send/recv, broadcast, or all-gather). Prints GB/s (size / time, per
receiver) and the ratios; `--json` writes them. With `--link-gbps`, every rank gets an emulated NIC
of that rate for traffic leaving its node (each rank its own node; for Tanz the destinations share
one node, so the ring all-gather runs on the fast intra-node links) and the report adds the ideal
time and our ratio to it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.cluster.replica_process import free_ports

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """'256MiB' → bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 256MiB, 1GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class BenchTransferConfig:
    """Options of `pdcluster bench transfer`."""

    algo: str = field(default="p2p", metadata={"help": "collective to measure",
                                               "choices": ["p2p", "chain", "tanz", "ring"]})
    size: str = field(default="256MiB", metadata={"help": "bytes each receiver gets"})
    ranks: int = field(default=2, metadata={"help": "processes taking part (sources included)"})
    sources: int = field(default=1, metadata={"help": "Tanz sources (the rest are destinations)"})
    link_gbps: float = field(default=0.0, metadata={"help": "emulated NIC rate per rank, Gbit/s (0: none)"})
    chunk: str = field(default="4MiB", metadata={"help": "transfer chunk size"})
    stripe: str = field(default="16MiB", metadata={"help": "Tanz stripe size"})
    region: str = field(default="16MiB", metadata={"help": "region size (one progress step per region)"})
    scatter: bool = field(default=False, metadata={"help": "KV-migration shape: receivers lay the regions "
                                                           "out back to front (use a small --region)"})
    repeats: int = field(default=3, metadata={"help": "timed repetitions per round (median)"})
    rounds: int = field(default=3, metadata={"help": "rounds of (ours, raw, gloo), interleaved so that "
                                                     "load from other processes hits all alike (median)"})
    ceilings: bool = field(default=True, metadata={"help": "also measure raw sockets and gloo"})
    json_out: Path | None = field(default=None, metadata={"help": "write the results as JSON here",
                                                          "flag": "--json"})

    def __post_init__(self) -> None:
        for name in ("size", "chunk", "stripe", "region"):
            parse_size(getattr(self, name))
        if self.ranks < 2:
            raise ValueError("--ranks must be at least 2")
        if self.rounds < 1 or self.repeats < 1:
            raise ValueError("--rounds and --repeats must be at least 1")
        if self.algo == "p2p" and self.ranks != 2:
            raise ValueError("p2p takes exactly 2 ranks")
        if self.algo == "tanz" and (self.sources < 1 or (self.ranks - self.sources) % self.sources):
            raise ValueError("Tanz needs the destinations (ranks - sources) to split evenly into lanes")


def _table_json(config: BenchTransferConfig, ports: list[int]) -> str:
    from transfer.core import Rank
    from transfer.ranktable import RankEntry, RankTable

    def node(rank: int) -> str:  # Tanz destinations share a node; everybody else has their own
        return "dest" if config.algo == "tanz" and rank >= config.sources else f"node{rank}"

    entries = tuple(RankEntry(Rank(r), "127.0.0.1", node(r), "cpu", f"127.0.0.1:{port}")
                    for r, port in enumerate(ports))
    return RankTable(entries).to_json()


def _jobs(config: BenchTransferConfig, kind: str, algo: str, n: int) -> list[Any]:
    from pdcluster.bench.transfer_ranks import Job

    size, gloo_port, ports = parse_size(config.size), free_ports(1)[0], free_ports(n)
    table = _table_json(config, ports)
    chunk, stripe, region = (parse_size(v) for v in (config.chunk, config.stripe, config.region))
    return [
        Job(kind, algo, r, tuple(range(n)), config.sources, size, chunk, stripe, region, config.link_gbps,
            config.repeats, table, gloo_port, config.scatter)
        for r in range(n)
    ]


def _measure(config: BenchTransferConfig, kind: str, algo: str, n: int, show: bool) -> float:
    """Run one measurement with `n` processes; return the median over repeats of the slowest rank."""
    from pdcluster.bench import transfer_ranks as ranks

    ctx = mp.get_context("spawn")
    barrier, results, progress = ctx.Barrier(n), ctx.Queue(), ctx.Queue()
    jobs = _jobs(config, kind, algo, n)
    raw_ports = free_ports(n)
    procs = []
    for job in jobs:
        if kind == "ours":
            args: tuple[Any, ...] = (ranks.run_ours, job, barrier, results, progress)
        elif kind == "raw":
            args = (ranks.run_raw, job, barrier, results, raw_ports)
        else:
            args = (ranks.run_gloo, job, barrier, results)
        procs.append(ctx.Process(target=args[0], args=args[1:], daemon=True))
    for proc in procs:
        proc.start()
    records = _collect(results, progress, procs, _progress_total(config, kind, n) if show else 0)
    for proc in procs:
        proc.join(timeout=60)
    if not all(r["ok"] for r in records):
        raise RuntimeError(f"{kind}: a receiver got wrong bytes")
    per_repeat = [max(r["times"][i] for r in records) for i in range(len(records[0]["times"]))]
    return statistics.median(per_repeat)


def _progress_total(config: BenchTransferConfig, kind: str, n: int) -> int:
    if kind != "ours":
        return 0
    regions = -(-parse_size(config.size) // parse_size(config.region))
    receivers = n - (config.sources if config.algo == "tanz" else 0 if config.algo == "ring" else 1)
    return regions * receivers


def _collect(results: Any, progress: Any, procs: list[Any], total: int) -> list[dict[str, Any]]:
    import queue

    from tqdm import tqdm

    bar = tqdm(total=total, unit="region", desc="regions landed", leave=False) if total else None
    records: list[dict[str, Any]] = []
    while len(records) < len(procs):
        try:
            records.append(results.get(timeout=0.05))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a benchmark process failed (see its traceback above)") from None
        while bar is not None:
            try:
                bar.update(progress.get_nowait())
            except queue.Empty:
                break
    if bar is not None:
        while bar.n < total:  # the last regions' reports may trail the results
            try:
                bar.update(progress.get(timeout=5))
            except queue.Empty:
                break
        bar.close()
    return records


def _ideal_seconds(config: BenchTransferConfig) -> float | None:
    if config.link_gbps <= 0:
        return None
    link = config.link_gbps * 1e9 / 8
    size = parse_size(config.size)
    if config.algo == "tanz":
        return size / config.sources / link  # each lane carries its stripes at the link rate
    if config.algo == "ring":
        return size * (config.ranks - 1) / config.ranks / link
    return size / link


def run(config: BenchTransferConfig) -> int:
    """Measure, print, and write the JSON report."""
    size = parse_size(config.size)
    samples: dict[str, list[float]] = {}
    for round_index in range(config.rounds):
        samples.setdefault("ours", []).append(
            _measure(config, "ours", config.algo, config.ranks, show=round_index == 0))
        for name, value in (_ceilings(config) if config.ceilings else {}).items():
            samples.setdefault(name, []).append(value)
    seconds = {name: statistics.median(values) for name, values in samples.items()}
    report = _report(config, size, seconds)
    for name, value in report["gbps"].items():
        print(f"{name:16s} {value:7.2f} GB/s   ({seconds[name]:.3f} s)")
    for name, value in report["ratios"].items():
        print(f"{name:32s} {value:6.3f}")
    if config.json_out is not None:
        config.json_out.parent.mkdir(parents=True, exist_ok=True)
        config.json_out.write_text(json.dumps(report, indent=1))
    return 0


def _ceilings(config: BenchTransferConfig) -> dict[str, float]:
    if config.link_gbps > 0:
        return {}  # the ceiling is the emulated link itself: see the ideal time
    out: dict[str, float] = {}
    if config.algo in ("p2p", "chain"):
        name = "raw_chain" if config.algo == "chain" else "raw_p2p"
        out[name] = _measure(config, "raw", "chain", config.ranks, show=False)
    if config.algo == "p2p":
        out["gloo_p2p"] = _measure(config, "gloo_p2p", "p2p", 2, show=False)
    elif config.algo == "ring":
        out["gloo_allgather"] = _measure(config, "gloo_allgather", "ring", config.ranks, show=False)
    else:
        out["gloo_broadcast"] = _measure(config, "gloo_broadcast", "chain", config.ranks, show=False)
    return out


def _report(config: BenchTransferConfig, size: int, seconds: dict[str, float]) -> dict[str, Any]:
    gbps = {name: size / 1e9 / t for name, t in seconds.items()}
    ratios = {f"ours/{name}": gbps["ours"] / value for name, value in gbps.items() if name != "ours"}
    ideal = _ideal_seconds(config)
    if ideal is not None:
        ratios["ours_time/ideal_time"] = seconds["ours"] / ideal
    return {"config": {k: str(v) for k, v in asdict(config).items()}, "seconds": seconds, "gbps": gbps,
            "ratios": ratios, "ideal_seconds": ideal, "python": sys.version.split()[0]}
