"""`pdcluster bench load`: weight loading and weight multicast, each against its own baseline.

1. **Load**: a safetensors checkpoint into an inactive replica's weight buffer (`ParamStore.
   load_from_disk`: header parsing, positional reads straight into the buffer, per-region
   readiness) against a raw `readinto` of the same files into a buffer of the same size, page cache
   warm, interleaved repeats, medians. Goal: ours/raw >= 0.80.
2. **Multicast**: one loaded replica and k = 1, 2, 4 inactive replicas (real `pdcluster replica`
   processes, tcp fabric, every rank its own node with an emulated NIC of `--link-gbps`): the time
   from RdmaBroadcast until every receiver's WaitRdmaDone returned (all ready), against p2p
   (SendParams/RecvParams) to one receiver. Goal: chain to 4 <= 1.3 x p2p to 1.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.cluster.replica_process import ReplicaProcess, free_ports, write_loopback_ranks


@dataclass
class BenchLoadConfig:
    """Options of `pdcluster bench load`."""

    model: Path | None = field(default=None, metadata={"help": "checkpoint folder; unset = make one"})
    hidden: int = field(default=1024, metadata={"help": "hidden size of the made checkpoint"})
    intermediate: int = field(default=4096, metadata={"help": "MLP size of the made checkpoint"})
    layers: int = field(default=4, metadata={"help": "layers of the made checkpoint"})
    vocab: int = field(default=8192, metadata={"help": "vocabulary of the made checkpoint"})
    repeats: int = field(default=5, metadata={"help": "timed repetitions per measurement (median)"})
    receivers: str = field(default="1,2,4", metadata={"help": "multicast receiver counts k"})
    link_gbps: float = field(default=2.0, metadata={"help": "emulated NIC rate per replica, Gbit/s"})
    multicast: bool = field(default=True, metadata={"help": "also run the multicast part"})
    json_out: Path | None = field(
        default=None, metadata={"help": "write the results as JSON here", "flag": "--json"}
    )

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        counts = [int(k) for k in self.receivers.split(",") if k.strip()]
        if not counts or min(counts) < 1:
            raise ValueError("--receivers must list positive counts, e.g. 1,2,4")
        if self.link_gbps <= 0:
            raise ValueError("--link-gbps must be positive (the comparison needs emulated links)")

    @property
    def receiver_counts(self) -> list[int]:
        """k values, ascending."""
        return sorted({int(k) for k in self.receivers.split(",") if k.strip()})


# ------------------------------------------------------------------------------------- load
def _make_checkpoint(config: BenchLoadConfig, folder: Path) -> Path:
    from pdcluster.tools.tiny_model import TinyModelConfig, make_tiny_model

    heads = max(config.hidden // 64, 1)
    tiny = TinyModelConfig(
        out=folder / "model",
        layers=config.layers,
        hidden=config.hidden,
        heads=heads,
        kv_heads=heads,
        intermediate=config.intermediate,
        vocab=config.vocab,
    )
    return make_tiny_model(tiny)


def _raw_read(files: list[Path], buffer: Any) -> float:
    """Seconds to `readinto` every file, back to back, into one preallocated buffer."""
    view = memoryview(buffer.numpy()).cast("B")
    start = time.perf_counter()
    offset = 0
    for file in files:
        with open(file, "rb", buffering=0) as handle:
            size = file.stat().st_size
            got = 0
            while got < size:
                n = handle.readinto(view[offset + got : offset + size])
                if not n:
                    break
                got += n
            offset += size
    return time.perf_counter() - start


def _ours(model: Path) -> tuple[float, Any]:
    """Seconds of LoadParams' work (load_from_disk) into a fresh inactive store, and the store."""
    import torch

    from replica.model.config import ModelConfig
    from replica.model.layout import WeightLayout
    from replica.params.readiness import ParamReadiness
    from replica.params.store import ParamStore

    config = ModelConfig.from_dir(model)
    layout = WeightLayout.for_config(config, "float32")
    store = ParamStore(
        layout,
        torch.zeros(layout.total_bytes, dtype=torch.uint8),
        ParamReadiness(config.num_layers, loaded=False),
        model.parent,
    )
    start = time.perf_counter()
    store.load_from_disk(model)
    return time.perf_counter() - start, store


def bench_load(model: Path, repeats: int) -> dict[str, Any]:
    """Median seconds of ours and raw, interleaved, after one warm-up of each."""
    import torch

    from replica.model.weights import checkpoint_files

    files = checkpoint_files(model)
    total_file_bytes = sum(f.stat().st_size for f in files)
    raw_buffer = torch.empty(total_file_bytes, dtype=torch.uint8)
    _raw_read(files, raw_buffer), _ours(model)  # warm the page cache and the allocator
    ours, raw = [], []
    for _ in range(repeats):
        ours.append(_ours(model)[0])
        raw.append(_raw_read(files, raw_buffer))
    weight_bytes = _ours(model)[1].layout.total_bytes
    t_ours, t_raw = statistics.median(ours), statistics.median(raw)
    return {
        "weight_bytes": weight_bytes,
        "file_bytes": total_file_bytes,
        "ours_s": t_ours,
        "raw_s": t_raw,
        "ours_gbps": weight_bytes / t_ours / 1e9,
        "raw_gbps": total_file_bytes / t_raw / 1e9,
        "ratio": (weight_bytes / t_ours) / (total_file_bytes / t_raw),
    }


# -------------------------------------------------------------------------------- multicast
class _Replicas:
    """One loaded replica (rank 0) and `n - 1` inactive ones, as subprocesses."""

    def __init__(self, model: Path, table: Path, n: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        from protos import generate_pb2_grpc as pb_grpc

        def start(rank: int) -> ReplicaProcess:
            args = [
                "--cluster",
                str(table),
                "--rank",
                str(rank),
                "--num-blocks",
                "16",
                "--transfer-timeout",
                "600",
            ] + (["--inactive"] if rank else [])
            return ReplicaProcess.start(model, *args, timeout=300.0)

        with ThreadPoolExecutor(n) as pool:
            self.procs = list(pool.map(start, range(n)))
        self.stubs = [pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(p.address)) for p in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()

    def warnings(self) -> list[str]:
        """The replicas' warning and error log lines (shown when a measurement fails)."""
        return [
            f"rank {r}: {line}"
            for r, p in enumerate(self.procs)
            for line in p.stderr_lines
            if " WARNING " in line or " ERROR " in line
        ]


def _timed_until_ready(replicas: _Replicas, ranks: list[int], start_calls: list[Any]) -> float:
    from concurrent.futures import ThreadPoolExecutor

    from protos import generate_pb2 as pb

    for rank in ranks[1:]:
        replicas.stubs[rank].ResetStatus(pb.ResetStatusRequest(), timeout=600)
    start = time.perf_counter()
    for call in start_calls:
        call()
    with ThreadPoolExecutor(len(ranks)) as pool:
        list(pool.map(lambda r: replicas.stubs[r].WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=600), ranks))
    elapsed = time.perf_counter() - start
    for rank in ranks[1:]:
        assert replicas.stubs[rank].Health(pb.HealthRequest(), timeout=60).state == "serving"
    return elapsed


def bench_multicast(
    model: Path, counts: list[int], link_gbps: float, repeats: int, folder: Path
) -> dict[str, Any]:
    """Median seconds until all ready: p2p to 1, chain to each k."""
    from protos import generate_pb2 as pb

    n = max(counts) + 1
    replicas = _Replicas(model, write_loopback_ranks(folder / "ranks.json", free_ports(n), link_gbps), n)
    try:
        stubs = replicas.stubs
        p2p = [
            _timed_until_ready(
                replicas,
                [0, 1],
                [
                    lambda: stubs[1].RecvParams(pb.RecvParamsRequest(src=0), timeout=60),
                    lambda: stubs[0].SendParams(pb.SendParamsRequest(dst=1), timeout=60),
                ],
            )
            for _ in range(repeats)
        ]
        out: dict[str, Any] = {"p2p_1_s": statistics.median(p2p), "chain_s": {}}
        for k in counts:
            ranks = list(range(k + 1))
            request = pb.BroadcastRequest(src_ranks=[0], dst_ranks=ranks[1:])
            calls = [lambda r=r, q=request: stubs[r].RdmaBroadcast(q, timeout=60) for r in ranks]
            times = [_timed_until_ready(replicas, ranks, calls) for _ in range(repeats)]
            out["chain_s"][k] = statistics.median(times)
        out["chain_over_p2p"] = {k: t / out["p2p_1_s"] for k, t in out["chain_s"].items()}
        return out
    except Exception:
        print("\n".join(replicas.warnings()), file=sys.stderr)
        raise
    finally:
        replicas.close()


def run(config: BenchLoadConfig) -> int:
    """Measure, print, and write the JSON report."""
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        folder = Path(tmp)
        model = config.model or _make_checkpoint(config, folder)
        load = bench_load(model, config.repeats)
        print(
            f"load: ours {load['ours_gbps']:.2f} GB/s ({load['ours_s']:.3f} s), raw read "
            f"{load['raw_gbps']:.2f} GB/s ({load['raw_s']:.3f} s), "
            f"ours/raw {load['ratio']:.3f} (goal >= 0.80)"
        )
        report: dict[str, Any] = {"config": {k: str(v) for k, v in vars(config).items()}, "load": load}
        if config.multicast:
            cast = bench_multicast(model, config.receiver_counts, config.link_gbps, config.repeats, folder)
            print(f"multicast @ {config.link_gbps} Gbit/s links: p2p to 1 {cast['p2p_1_s']:.3f} s")
            for k, seconds in cast["chain_s"].items():
                print(
                    f"  chain to {k}: {seconds:.3f} s = {cast['chain_over_p2p'][k]:.3f} x p2p to 1"
                    + ("  (goal <= 1.3)" if k == 4 else "")
                )
            report["multicast"] = cast
    if config.json_out is not None:
        config.json_out.parent.mkdir(parents=True, exist_ok=True)
        config.json_out.write_text(json.dumps(report, indent=1, default=str))
    return 0
