"""`pdcluster bench migration`: KV bytes/s of Migrate ‖ Immigrate against the fabric's p2p, same run.

```
 bench ──gRPC──► replica P (rank 0) ══ tcp: header, one gather/scatter run ══► replica D (rank 1)
   │   PrefillV2 (untimed) · Migrate ‖ Immigrate (timed, client side) · ClearCache on D
   └──queues──► p2p worker (rank 2) ══ send_regions of ONE region of the same bytes ══► p2p worker (rank 3)
```
For each batch shape (requests × prompt tokens) the two replica processes move the batch's KV
(every layer's prompt pages, one page of one layer per region) and, right after, two bare fabric
processes move the same number of bytes as one contiguous region with the transfer layer's p2p
(with its end-of-transfer confirmation, like the migration), starting from a cold CPU cache
(`--evict-mib`: otherwise a baseline of up to ~32 MiB runs from the L3 cache and looks twice as
fast as any real transfer). The two alternate; times are medians over `--repeats`, the migration's
measured by the client from issuing Migrate ‖ Immigrate until both returned. The report gives GB/s
and the ratio migration/p2p per shape (goal ≥ 0.80), their minimum and median, and the ratio of the
whole sweep's bytes/s (each shape once: the sum of p2p times over the sum of migration times, which
weighs shapes by their bytes).

The model is a random-weight checkpoint made for the run (`--layers`, `--hidden`, `--kv-heads`),
with more KV heads and layers than the tests' tiny one so that the byte counts mean something.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.cluster.replica_process import ReplicaProcess, free_ports, write_loopback_ranks

_CALL_S = 300.0


@dataclass
class BenchMigrationConfig:
    """Options of `pdcluster bench migration`."""

    requests: list[int] = field(default_factory=lambda: [1, 8, 64], metadata={"help": "requests per batch"})
    tokens: list[int] = field(default_factory=lambda: [128, 512, 2048], metadata={"help": "prompt tokens"})
    max_batch_tokens: int = field(
        default=131072, metadata={"help": "skip shapes with more prompt tokens than this in one batch"}
    )
    layers: int = field(default=8, metadata={"help": "decoder layers of the benchmark model"})
    hidden: int = field(default=128, metadata={"help": "hidden size of the benchmark model"})
    kv_heads: int = field(default=8, metadata={"help": "KV heads (= attention heads) of the benchmark model"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    repeats: int = field(default=3, metadata={"help": "timed repetitions per shape (the median is reported)"})
    link_gbps: float = field(default=0.0, metadata={"help": "emulated NIC per rank, Gbit/s (0: none)"})
    torch_threads: int = field(default=1, metadata={"help": "torch threads of each replica"})
    evict_mib: int = field(
        default=64, metadata={"help": "MiB of scratch each p2p process writes before a repetition"}
    )
    log_dir: Path | None = field(
        default=None, metadata={"help": "write each replica's log (one line per migration) here"}
    )
    json_out: Path | None = field(
        default=None, metadata={"help": "write the results as JSON here", "flag": "--json"}
    )

    def __post_init__(self) -> None:
        if not self.requests or not self.tokens or min(self.requests + self.tokens) <= 0:
            raise ValueError("--requests and --tokens need positive values")
        if self.repeats <= 0 or self.layers <= 0 or self.kv_heads <= 0 or self.hidden % self.kv_heads:
            raise ValueError("--repeats/--layers/--kv-heads must be positive and divide --hidden")

    def shapes(self) -> list[tuple[int, int]]:
        """(requests, tokens) pairs within the token budget, smallest first."""
        pairs = [(r, t) for r in self.requests for t in self.tokens if r * t <= self.max_batch_tokens]
        return sorted(pairs, key=lambda p: (p[0] * p[1], p))

    def page_bytes(self) -> int:
        """One page of one layer: K and V of `block_size` tokens, float32."""
        return 2 * self.block_size * self.hidden * 4  # kv_heads * head_dim == hidden (no GQA here)

    def kv_bytes(self, requests: int, tokens: int) -> int:
        """Bytes a migration of that shape moves."""
        return requests * -(-tokens // self.block_size) * self.page_bytes() * self.layers


# ---------------------------------------------------------------------------------- setup
def _make_model(config: BenchMigrationConfig, out: Path) -> Path:
    from pdcluster.tools.tiny_model import TinyModelConfig, make_tiny_model

    longest = max(config.tokens) + 8
    make_tiny_model(
        TinyModelConfig(
            out=out,
            layers=config.layers,
            hidden=config.hidden,
            heads=config.kv_heads,
            kv_heads=config.kv_heads,
            intermediate=2 * config.hidden,
            max_positions=max(512, longest),
        )
    )
    return out


def _start_replica(config: BenchMigrationConfig, model: Path, table: Path, rank: int) -> ReplicaProcess:
    pages = max(r * (-(-t // config.block_size) + 1) for r, t in config.shapes()) + 16
    args = {
        "--rank": rank,
        "--cluster": table,
        "--num-blocks": pages,
        "--block-size": config.block_size,
        "--torch-threads": config.torch_threads,
        "--max-batch-prefill-tokens": config.max_batch_tokens,
        "--transfer-timeout": _CALL_S,
    }
    log = None if config.log_dir is None else config.log_dir / f"replica-{rank}.log"
    flat = [str(part) for pair in args.items() for part in pair]
    return ReplicaProcess.start(model, *flat, timeout=_CALL_S, log=log)


# ------------------------------------------------------------------------------ p2p workers
def _p2p_worker(
    rank: int, table_json: str, max_bytes: int, commands: Any, results: Any, barrier: Any, evict: int
) -> None:
    """One side of the fabric p2p baseline (spawned process): move `nbytes` as one region, repeatedly.

    Before each repetition it streams through `evict` bytes of scratch memory, so that the buffer does
    not start in the CPU cache: a migrated batch's pages are not cache-hot either (the prefill wrote
    every layer, then ran the head; the receiver's pages were last written long before).
    """
    from transfer.collectives import TransferOptions, recv_regions, send_regions
    from transfer.core import Deadline, Stream
    from transfer.fabric import create_fabric
    from transfer.ranktable import parse_rank_table

    table = parse_rank_table(table_json)
    fabric = create_fabric("tcp", table, table.ranks[rank])
    buffer = bytearray(max_bytes)
    _touch(buffer)
    fabric.register("buf", buffer)
    peer = table.ranks[1 - rank]
    scratch, pattern = bytearray(evict), bytes(range(256)) * (evict // 256)
    tag = 0
    while (command := commands.get()) is not None:
        nbytes, repeats = command
        times = []
        for _ in range(repeats):
            tag += 1
            scratch[: len(pattern)] = pattern
            barrier.wait(_CALL_S)
            start = time.perf_counter()
            move = send_regions if rank == 0 else recv_regions
            move(
                fabric,
                peer,
                "buf",
                [(0, nbytes)],
                Stream.KV,
                Deadline.after(_CALL_S),
                options=TransferOptions(tag=tag),
            )
            times.append(time.perf_counter() - start)
        results.put((rank, times))
    fabric.close()


def _touch(buffer: bytearray, step: int = 64 << 20) -> None:
    """Write every page: a fresh buffer maps the kernel's shared zero page, which a sender would read
    from the CPU cache (an unrealistically fast source); a KV cache's pages hold real data."""
    block = bytes(range(256)) * (step // 256)
    view = memoryview(buffer)
    for offset in range(0, len(buffer), step):
        part = view[offset : offset + step]
        part[:] = block[: len(part)]


class _P2p:
    """Two persistent fabric processes measuring p2p of a given size on demand."""

    def __init__(self, config: BenchMigrationConfig, table: Path, max_bytes: int) -> None:
        evict = config.evict_mib << 20
        ctx = mp.get_context("spawn")
        records = json.loads(table.read_text())["ranks"][2:4]
        sub = json.dumps({"ranks": records})
        self.commands = [ctx.Queue(), ctx.Queue()]
        self.results = ctx.Queue()
        self.barrier = ctx.Barrier(2)  # kept referenced: the children attach to it as they start
        self.procs = [
            ctx.Process(
                target=_p2p_worker,
                daemon=True,
                args=(r, sub, max_bytes, self.commands[r], self.results, self.barrier, evict),
            )
            for r in range(2)
        ]
        for proc in self.procs:
            proc.start()

    def measure(self, nbytes: int, repeats: int) -> float:
        for queue in self.commands:
            queue.put((nbytes, repeats))
        got = dict(self._result(time.monotonic() + _CALL_S * repeats) for _ in range(2))
        return statistics.median(max(a, b) for a, b in zip(got[0], got[1], strict=True))

    def _result(self, until: float) -> tuple[int, list[float]]:
        import queue

        while time.monotonic() < until:
            try:
                return self.results.get(timeout=0.5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in self.procs):
                    raise RuntimeError("a p2p benchmark process failed (see its traceback above)") from None
        raise TimeoutError("the p2p benchmark processes did not answer in time")

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for proc in self.procs:
            proc.join(timeout=30)


# ------------------------------------------------------------------------------ migrations
class _Migrator:
    """The bench's gRPC client of the two replicas."""

    def __init__(self, p: ReplicaProcess, d: ReplicaProcess) -> None:
        import grpc

        from protos import generate_pb2_grpc as pb_grpc

        self.channels = [grpc.insecure_channel(r.address) for r in (p, d)]
        self.p, self.d = (pb_grpc.TextGenerationServiceStub(c) for c in self.channels)
        self.pool = ThreadPoolExecutor(2)
        self.next_id = 1

    def _batch(self, requests: int, tokens: int) -> Any:
        from protos import generate_pb2 as pb

        stop = pb.StoppingCriteriaParameters(max_new_tokens=2, ignore_eos_token=True)
        prompt = [3 + (i % 250) for i in range(tokens)]
        base = self.next_id * 1000
        self.next_id += 1
        reqs = [
            pb.Request(id=base + i, input_tokens=prompt, stopping_parameters=stop) for i in range(requests)
        ]
        return pb.Batch(id=self.next_id, requests=reqs, size=requests)

    def once(self, requests: int, tokens: int) -> float:
        """Prefill on P (untimed), then the timed Migrate ‖ Immigrate; the batch is cleared on D."""
        from protos import generate_pb2 as pb

        batch = self._batch(requests, tokens)
        self.p.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=_CALL_S)
        start = time.perf_counter()
        sent = self.pool.submit(
            self.p.Migrate, pb.MigrateRequest(batch=batch, src=[0], dst=[1]), timeout=_CALL_S
        )
        got = self.pool.submit(
            self.d.Immigrate, pb.ImmigrateRequest(batch=batch, src=[0], dst=[1]), timeout=_CALL_S
        )
        sent.result()
        got.result()
        seconds = time.perf_counter() - start
        self.d.ClearCache(pb.ClearCacheRequest(id=batch.id), timeout=_CALL_S)
        return seconds

    def close(self) -> None:
        self.pool.shutdown()
        for channel in self.channels:
            channel.close()


# ------------------------------------------------------------------------------------ run
def _rows(config: BenchMigrationConfig, migrator: _Migrator, p2p: _P2p) -> list[dict[str, Any]]:
    from tqdm import tqdm

    first = config.shapes()[0]
    migrator.once(*first)  # warm-up (connections, first-call costs): not measured
    p2p.measure(config.kv_bytes(*first), 1)
    rows = []
    for requests, tokens in tqdm(config.shapes(), desc="batch shapes", leave=False):
        nbytes = config.kv_bytes(requests, tokens)
        # interleaved, so that both see the same background load of a shared machine
        pairs = [(migrator.once(requests, tokens), p2p.measure(nbytes, 1)) for _ in range(config.repeats)]
        migrate = statistics.median(m for m, _ in pairs)
        baseline = statistics.median(b for _, b in pairs)
        rows.append(
            {
                "requests": requests,
                "tokens": tokens,
                "bytes": nbytes,
                "regions": nbytes // config.page_bytes(),
                "migrate_s": migrate,
                "p2p_s": baseline,
                "migrate_gbps": nbytes / 1e9 / migrate,
                "p2p_gbps": nbytes / 1e9 / baseline,
                "ratio": baseline / migrate,
            }
        )
        row = rows[-1]
        print(
            f"{requests:3d} x {tokens:5d}tok {nbytes / 2**20:7.1f}MiB migrate {row['migrate_gbps']:6.2f} GB/s"
            f"  p2p {row['p2p_gbps']:6.2f} GB/s  ratio {row['ratio']:.2f}",
            flush=True,
        )
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per-shape ratios (min, median) and the sweep's KV bytes/s: every shape's bytes over its time."""
    ratios = [r["ratio"] for r in rows]
    aggregate = sum(r["p2p_s"] for r in rows) / sum(r["migrate_s"] for r in rows)
    return {
        "min_ratio": min(ratios),
        "median_ratio": statistics.median(ratios),
        "aggregate_ratio": aggregate,
        "goal": 0.80,
    }


def run(config: BenchMigrationConfig) -> int:
    """Start the replicas and the p2p pair, measure every shape, print and write the report."""
    with tempfile.TemporaryDirectory(prefix="pdcluster-bench-migration-") as tmp:
        model = _make_model(config, Path(tmp) / "model")
        table = write_loopback_ranks(Path(tmp) / "ranks.json", free_ports(4), config.link_gbps)
        replicas: list[ReplicaProcess] = []
        p2p = migrator = None
        try:
            replicas = [_start_replica(config, model, table, rank) for rank in (0, 1)]
            p2p = _P2p(config, table, max(config.kv_bytes(r, t) for r, t in config.shapes()))
            migrator = _Migrator(*replicas)
            rows = _rows(config, migrator, p2p)
        finally:
            if migrator is not None:
                migrator.close()
            if p2p is not None:
                p2p.close()
            for replica in replicas:
                replica.stop()
    summary = _summary(rows)
    print(
        f"migration/p2p: min {summary['min_ratio']:.2f}, median {summary['median_ratio']:.2f}, "
        f"all shapes' bytes together {summary['aggregate_ratio']:.2f} (goal >= 0.80)"
    )
    if config.json_out is not None:
        config.json_out.parent.mkdir(parents=True, exist_ok=True)
        report = {"config": {k: str(v) for k, v in asdict(config).items()}, "rows": rows, "summary": summary}
        config.json_out.write_text(json.dumps(report, indent=1))
    return 0
