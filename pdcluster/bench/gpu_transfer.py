"""`pdcluster bench gpu-transfer`: moving GPU state between two ranks of one host, as ratios to a ceiling.

Two processes on one device (issue 24 part 8), all in one run:

    leg              what moves                                   compared with            goal
    kv_ipc           KV pages, cuda-ipc, scattered on arrival     a device copy, same bytes  ≥ 0.8
    kv_staged_tcp    the same pages, CUDA memory over staged tcp  kv_host_tcp               ≥ 0.8
    kv_host_tcp      the same pages, host memory over tcp         (the ceiling above)
    weights_ipc      weights in layer regions, cuda-ipc p2p       a device copy, same bytes  ≥ 0.8

The legs run the fabric and the collectives a replica's migration and SendParams/RecvParams use
(`send_regions` / `recv_regions`), not whole replicas: the bytes, not a checkpoint, are the point.
GB/s is bytes / the slower rank's time, median over `--repeats` after a warm-up. `--json` writes
every time, GB/s, ratio and whether its goal was met; a missed goal is a result, not an error.
On `--device cpu` the ipc legs run on the fabric's CPU backend (shared memory) and the staged leg
moves host memory: a check of the protocol and the report, not of GPU figures.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.bench.gpu_transfer_ranks import LegSpec, RankJob
from pdcluster.bench.transfer import parse_size
from transfer.core import Segments

GOAL = 0.8
# ratio name -> (leg, what it is divided by)
RATIOS = {
    "kv_ipc/device_copy": ("kv_ipc", "device_copy_kv"),
    "kv_staged_tcp/kv_host_tcp": ("kv_staged_tcp", "kv_host_tcp"),
    "weights_ipc/device_copy": ("weights_ipc", "device_copy_weights"),
}


@dataclass
class BenchGpuTransferConfig:
    """Options of `pdcluster bench gpu-transfer`."""

    device: str = field(default="auto", metadata={"help": "cuda, cpu (the CPU doubles), or auto (cuda where "
                                                          "present)", "choices": ["auto", "cuda", "cpu"]})
    kv_size: str = field(default="1GiB", metadata={"help": "KV bytes migrated per transfer"})
    page: str = field(default="256KiB", metadata={"help": (
        "KV page (one region; 256 KiB: 16 tokens x 32 heads x 128 x K and V in bfloat16)")})
    weights_size: str = field(default="2GiB", metadata={"help": "weight bytes sent per transfer"})
    layer: str = field(default="64MiB", metadata={"help": "weight region (one layer's bytes)"})
    chunk: str = field(default="16MiB", metadata={"help": "transfer chunk size (one fabric message)"})
    repeats: int = field(default=3, metadata={"help": "timed transfers per leg after a warm-up (median)"})
    timeout: float = field(default=120.0, metadata={"help": "seconds for the whole run"})
    json_out: Path | None = field(default=None, metadata={"help": "write the results as JSON here",
                                                          "flag": "--json"})

    def __post_init__(self) -> None:
        sizes = {name: parse_size(getattr(self, name))
                 for name in ("kv_size", "page", "weights_size", "layer", "chunk")}
        if min(sizes.values()) < 1 or self.repeats < 1 or self.timeout <= 0:
            raise ValueError("sizes and --repeats must be at least 1, --timeout positive")
        if sizes["page"] > sizes["kv_size"] or sizes["layer"] > sizes["weights_size"]:
            raise ValueError("--page must fit in --kv-size and --layer in --weights-size")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"--device takes auto, cuda or cpu, got {self.device!r}")


def resolve_device(device: str) -> str:
    """`auto` → cuda where torch sees a CUDA device, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def kv_regions(size: int, page: int) -> tuple[Segments, Segments]:
    """KV migration's shape: the sender's pages in order, landing back to front on the receiver
    (different pages on each side, same lengths); a last partial page is left out."""
    pages = size // page
    send = [(p * page, page) for p in range(pages)]
    recv = [((pages - 1 - p) * page, page) for p in range(pages)]
    return send, recv


def layer_regions(size: int, layer: int) -> Segments:
    """Weights in layer-sized regions at the same offsets on both sides (the last one shorter)."""
    return [(offset, min(layer, size - offset)) for offset in range(0, size, layer)]


def legs(config: BenchGpuTransferConfig) -> tuple[LegSpec, ...]:
    """The four legs of the module docstring."""
    send, recv = kv_regions(parse_size(config.kv_size), parse_size(config.page))
    weights = layer_regions(parse_size(config.weights_size), parse_size(config.layer))
    return (LegSpec("kv_ipc", "ipc", "kv", send, recv),
            LegSpec("kv_staged_tcp", "staged", "kv", send, recv),
            LegSpec("kv_host_tcp", "tcp", "kv", send, recv),
            LegSpec("weights_ipc", "ipc", "weights", weights, weights))


def moved_bytes(config: BenchGpuTransferConfig) -> dict[str, int]:
    """Bytes each transfer of a leg moves (whole KV pages only), and of each device copy."""
    kv = parse_size(config.kv_size) // parse_size(config.page) * parse_size(config.page)
    weights = parse_size(config.weights_size)
    return {"kv_ipc": kv, "kv_staged_tcp": kv, "kv_host_tcp": kv, "weights_ipc": weights,
            "device_copy_kv": kv, "device_copy_weights": weights}


def leg_seconds(records: list[dict[str, Any]]) -> dict[str, float]:
    """Per leg, the median over repeats of the slower rank's time."""
    names = records[0]["times"].keys()
    return {name: statistics.median(max(pair) for pair in zip(*(r["times"][name] for r in records),
                                                               strict=True))
            for name in names}


def report(config: BenchGpuTransferConfig, device: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON report from both ranks' records (pure: the CPU tests build records by hand)."""
    sender = next(r for r in records if r["rank"] == 0)
    seconds = leg_seconds(records)
    seconds.update({f"device_copy_{name}": s for name, s in sender["copies"].items()})
    sizes = moved_bytes(config)
    gbps = {name: sizes[name] / 1e9 / s for name, s in seconds.items()}
    ratios = {}
    for name, (leg, ceiling) in RATIOS.items():
        value = gbps[leg] / gbps[ceiling]
        ratios[name] = {"value": value, "goal": GOAL, "met": value >= GOAL}
    return {"config": {k: str(v) for k, v in asdict(config).items()}, "device": device,
            "device_name": sender.get("device_name", ""), "bytes": sizes, "seconds": seconds,
            "gbps": gbps, "ratios": ratios, "goals_met": sum(r["met"] for r in ratios.values()),
            "goals": len(ratios), "verified": all(r["ok"] for r in records),
            "python": sys.version.split()[0]}


def _jobs(config: BenchGpuTransferConfig, device: str) -> list[RankJob]:
    from transfer.ports import free_ports

    ports = free_ports(6)
    by_fabric = {"ipc": (ports[0], ports[1]), "staged": (ports[2], ports[3]), "tcp": (ports[4], ports[5])}
    sizes = {"kv": parse_size(config.kv_size), "weights": parse_size(config.weights_size)}
    return [RankJob(rank, device, legs(config), sizes, by_fabric, parse_size(config.chunk), config.repeats,
                    config.timeout) for rank in (0, 1)]


def measure(config: BenchGpuTransferConfig, device: str) -> list[dict[str, Any]]:
    """Run both ranks (spawned processes); their records, or RuntimeError naming what failed."""
    from pdcluster.bench.gpu_transfer_ranks import run_rank

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(job, barrier, results), daemon=True)
             for job in _jobs(config, device)]
    for proc in procs:
        proc.start()
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + config.timeout
    try:
        while len(records) < len(procs):
            try:
                records.append(results.get(timeout=0.2))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a benchmark process failed (its traceback is above)") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no result after --timeout {config.timeout} s") from None
    finally:
        for proc in procs:  # after a failure the other rank waits at the barrier: no grace then
            proc.join(timeout=30 if len(records) == len(procs) else 0)
            if proc.is_alive():
                proc.kill()
    return records


def run(config: BenchGpuTransferConfig) -> int:
    """Measure, print, write the JSON report; 1 when a receiver got wrong bytes."""
    device = resolve_device(config.device)
    out = report(config, device, measure(config, device))
    for name, value in out["gbps"].items():
        print(f"{name:22s} {value:8.2f} GB/s   ({out['seconds'][name]:.4f} s, {out['bytes'][name]} bytes)")
    for name, ratio in out["ratios"].items():
        verdict = "met" if ratio["met"] else "MISSED"
        print(f"{name:28s} {ratio['value']:6.3f}   goal >= {ratio['goal']}: {verdict}")
    print(f"gpu-transfer on {out['device_name']}: {out['goals_met']} of {out['goals']} goals met, "
          f"bytes {'verified' if out['verified'] else 'WRONG'}")
    if config.json_out is not None:
        config.json_out.parent.mkdir(parents=True, exist_ok=True)
        config.json_out.write_text(json.dumps(out, indent=1))
    return 0 if out["verified"] else 1
