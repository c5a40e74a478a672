"""Starting a tensor-parallel group from its leader (rank 0, the process serving gRPC).

```
 leader: store (port 0) ─► spawn `python -m replica.tp.worker --rank r` for r in 1..N-1 ─► TpGroup(rank 0,
         hosts the store) ─► build_rank ─► TpRunner           workers: TpGroup(rank r) ─► build_rank ─► loop
```
Joining has the group's deadline too: a worker that never starts fails the leader's start.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from replica.model.layout import Shard
from replica.model.weights import dtype_name
from replica.tp.group import DEFAULT_TIMEOUT_S, Command, Op, TpGroup, host_store
from replica.tp.kvmove import ShardMover
from replica.tp.rank import RankModel, RankSpec, build_rank, share_cpu_threads
from replica.tp.runner import TpRunner
from replica.tp.weights import GroupReadiness, GroupWeights
from transfer.ranktable import load_rank_table

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """Where the group's ranks listen for per-rank KV migration and weights: rank r is global rank
    `base_rank + r` of the rank table in `cluster` (contiguous, as the seeds' groups are), an entry
    whose `tp_group` is `base_rank` (so another replica's rank is never taken for a worker's)."""

    cluster: Path
    base_rank: int
    fabric: str = "tcp"  # the replica's --fabric: each worker opens its endpoint on it (fabric.py)

    @classmethod
    def of(cls, cluster: Path | None, base_rank: int, world: int, fabric: str = "tcp") -> Endpoints | None:
        """The group's endpoints when the table lists every rank of the group (`tp_group`), else None
        (then migrations and weight operations are refused: `replica.migration.manager`)."""
        if cluster is None:
            return None
        table = load_rank_table(cluster)
        ranks = [base_rank + r for r in range(1, world)]
        missing = [r for r in ranks if r not in table or table[r].tp_group != base_rank]
        if missing:
            log.warning("the rank table %s lists no ranks %s with tp_group %d (this group's tp ranks 1..%d): "
                        "KV migrations and weight operations are refused", cluster, missing, base_rank,
                        world - 1)
            return None
        return cls(cluster, base_rank, fabric)

    def args(self, rank: int) -> list[str]:
        """Worker `rank`'s command-line arguments naming its endpoint."""
        return ["--cluster", str(self.cluster), "--transfer-rank", str(self.base_rank + rank),
                "--fabric", self.fabric]


def worker_command(spec: RankSpec, rank: int, world: int, store: str, device: torch.device,
                   timeout_s: float, endpoints: Endpoints | None = None) -> list[str]:
    """The command line of worker `rank`, under `setpriv --pdeathsig TERM` where util-linux has it
    (the worker dies with its leader even if the leader is killed; an exec wrapper, not a preexec_fn,
    because the leader serves gRPC and a forked gRPC process may abort before it execs). The signal
    follows the spawning thread: start the group on one that lives as long as the replica (the
    engine thread does)."""
    setpriv = shutil.which("setpriv")
    return [
        *([setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []),
        sys.executable, "-m", "replica.tp.worker", "--model", str(spec.model_dir),
        "--dtype", dtype_name(spec.dtype), "--device", str(device), "--rank", str(rank),
        "--world", str(world), "--store", store, "--num-blocks", str(spec.num_blocks),
        "--block-size", str(spec.block_size), "--attention-backend", spec.attention_backend,
        "--timeout", str(timeout_s), *(endpoints.args(rank) if endpoints is not None else []),
        *(["--inactive"] if spec.inactive else []),
    ]


@dataclass
class Leader:
    """Rank 0's side of a running group: its shard, its runner, the worker processes it started."""

    group: TpGroup
    rank: RankModel
    runner: TpRunner
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    stopping: bool = False

    def watch(self) -> None:
        """A worker process that ends before `stop` breaks the group (`TpGroup.fail`) at once, even
        with no step running: rank 0 learns it without waiting for a collective's deadline."""
        for rank, worker in enumerate(self.workers, start=1):
            threading.Thread(target=self._await_worker, args=(rank, worker), name=f"tp-watch-{rank}",
                             daemon=True).start()

    def _await_worker(self, rank: int, worker: subprocess.Popen[bytes]) -> None:
        code = worker.wait()
        if not self.stopping:
            self.group.fail(f"rank {rank} (pid {worker.pid}) exited with {code}")

    def stop(self) -> None:
        """Tell the workers to leave, wait for them (with a deadline), then leave the group; a broken
        group's workers are killed (nothing is left for them to do). A broken gloo group is left too:
        with its peers gone its failed collectives end at once, and a gloo thread still releasing one
        while the interpreter exits aborts the process (`std::terminate`). A broken NCCL group is left
        as is (a collective may still hang in it). Once: later calls do nothing."""
        if self.stopping:
            return
        self.stopping = True
        if self.group.failed:
            self._kill_workers()
            if self.group.backend == "gloo":
                self.group.close()
            return
        self.group.commands.publish(Command(Op.STOP))
        for worker in self.workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(timeout=10)
        self.group.close()

    def _kill_workers(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker %d did not end after SIGKILL", worker.pid)


def start_group(spec: RankSpec, world: int, device: torch.device,
                timeout_s: float = DEFAULT_TIMEOUT_S, host: str = "127.0.0.1",
                endpoints: Endpoints | None = None) -> Leader:
    """Spawn ranks 1..world-1, join as rank 0 and load this rank's shard; with `endpoints` every
    worker opens its fabric endpoint and the runner moves KV per rank (`runner.shard_mover`)."""
    share_cpu_threads(world)
    store = host_store(host, world, timeout_s)
    address = f"{host}:{store.port}"
    workers = [
        subprocess.Popen(worker_command(spec, r, world, address, device, timeout_s, endpoints))
        for r in range(1, world)
    ]
    try:
        group = TpGroup(Shard(0, world), store, device, timeout_s)
        rank = build_rank(spec, group, device)
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    runner = TpRunner(rank.model, rank.cache, spec.attention_backend, group)
    if endpoints is not None:
        runner.shard_mover = ShardMover(group)
        regions = [(region.kind, region.index) for region in rank.layout.regions]
        readiness = GroupReadiness(rank.model.config.num_layers, not spec.inactive, store, world, regions)
        runner.group_weights = GroupWeights(group, readiness)
    leader = Leader(group, rank, runner, workers)
    leader.watch()
    return leader
