"""Per-rank KV migration: tp_rank i of the sender moves its shard to tp_rank i of the receiver.

```
 rank 0 (Migrations)                                  ranks r > 0 (workers)
 send_batch / receive: once the have fixed the pages   serve_worker: Command(MOVE_KV, ShardJob)
   ShardMover.start(job) ─ publish ─────────────────►   ShardEndpoint.run(job) on a thread:
   its own shard over the replica's fabric               send_regions / recv_regions over its own
   ShardMover.wait(pending): every worker's result ◄──   fabric (global rank R + r), p2p confirmed;
     store "tp/done/<job>/<r>" = "ok" | "<kind>|why"     result under "tp/done/<job>/<r>"
```
Ranks of a group are contiguous global ranks of the rank table (tp_rank r of the replica with
`--rank R` is global rank R + r, listening on its entry's transfer address), so tp_rank r's peer
is the peer replica's rank + r. Every rank's pages have the same size and ids (the group's page
table), so the regions rank 0 computed are every rank's. A worker's own transfer is a confirmed
p2p run (tag: the migration's nonce), so both workers of a pair learn the pair's outcome; rank 0
waits for its workers' results (`results.py`; deadline: the migration's, plus a grace for the report).
When rank 0's own part fails (or its caller cancels), it aborts the workers' parts (`ShardAbort`:
each resets its streams with its peer, whose part then fails too) before it waits for them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from replica.cluster import KV_BUFFER, ReplicaCluster
from replica.errors import ReplicaError
from replica.tp.group import Command, Op, TpGroup
from replica.tp.results import await_results, report
from transfer.collectives import TransferOptions, recv_regions, send_regions
from transfer.core import Deadline, control_stream
from transfer.errors import PeerGone, TransferError
from transfer.plans import OpKind

log = logging.getLogger(__name__)

SHARD_STREAM = 16
"""Streams of the workers' KV transfers: 16 when the sender's global rank is the lower, else 17
(transfers both ways between one pair must not share a stream: their confirmations would cross)."""
_jobs = itertools.count()
_ABORT_POLL_S = 0.05
T = TypeVar("T")
Region = tuple[int, int]
Runs = Callable[[Sequence[int]], Iterable[Sequence[Region]]]
"""A migration's runs of regions given the receiver's skips (`replica.migration.wire.Runs`)."""


@dataclass(frozen=True)
class ShardJob:
    """One migration's part for every worker: peers[r] is tp_rank r's peer (global rank)."""

    job: str
    direction: OpKind
    peers: tuple[int, ...]
    regions: tuple[tuple[int, int], ...]
    seconds: float  # the migration's time left when rank 0 published the job
    tag: int  # the migration's nonce: the confirmation tag of each worker's p2p run


@dataclass(frozen=True)
class ShardAbort:
    """Rank 0's part of migration `job` failed (or its caller gave up): fail the workers' parts now."""

    job: str
    reason: str


def peer_ranks(peer: int, world: int) -> tuple[int, ...]:
    """The peer group's global ranks, indexed by tp_rank (contiguous from its rank 0's)."""
    return tuple(peer + r for r in range(world))


def shard_stream(sender: int, receiver: int) -> int:
    """The stream of a worker transfer from global rank `sender` to `receiver`."""
    return SHARD_STREAM + (0 if sender < receiver else 1)


class ShardMover:
    """Rank 0's side: publish a migration's shard job to the workers, wait for their results."""

    def __init__(self, group: TpGroup) -> None:
        self.group = group
        self.world = group.shard.world

    def start(self, direction: OpKind, peer: int, regions: Sequence[tuple[int, int]], tag: int,
              deadline: Deadline) -> ShardJob:
        """Tell every worker to move its shard of `regions` with its peer of the group at `peer`."""
        job = ShardJob(f"{time.time_ns()}-{next(_jobs)}", direction, peer_ranks(peer, self.world),
                       tuple(regions), deadline.remaining(), tag)
        self.group.commands.publish(Command(Op.MOVE_KV, job))
        return job

    def abort(self, job: ShardJob, reason: str) -> None:
        """Fail every worker's part of `job` at once (their peers see the reset and fail too)."""
        self.group.commands.publish(Command(Op.MOVE_KV, ShardAbort(job.job, reason)))

    def wait(self, job: ShardJob, deadline: Deadline) -> None:
        """Every worker's result (within the deadline and a grace); raise the first failure."""
        what = f"KV migration ({job.direction.value})"
        await_results(self.group.store, job.job, self.world, deadline, what)


def with_shards(regions: Runs, start: Callable[[list[Region]], None]) -> Runs:
    """`regions`, starting the workers' shard jobs over the same regions once the skips are known."""
    def runs_of(skips: Sequence[int]) -> list[list[Region]]:
        every = [list(run) for run in regions(skips)]
        start([region for run in every for region in run])
        return every
    return runs_of


def settled(mover: ShardMover | None, jobs: list[ShardJob], deadline: Deadline, move: Callable[[], T]) -> T:
    """Run rank 0's own `move`, then wait for the workers' jobs it started: every rank's pages are
    settled before the caller frees or adopts them. A worker's failure fails the call; when rank 0
    failed too, its error is the one raised (the workers' are logged)."""
    try:
        result = move()
    except BaseException as exc:
        for job in jobs:
            try:
                assert mover is not None
                mover.abort(job, f"rank 0's part failed: {type(exc).__name__}: {exc}")
                mover.wait(job, deadline)
            except ReplicaError as exc:
                log.info("a tensor-parallel rank's shard failed too: %s", exc)
        raise
    for job in jobs:
        assert mover is not None
        mover.wait(job, deadline)
    return result


class ShardEndpoint:
    """A worker's side: its own fabric (global rank R + r) over its KV pages, and a store client
    of its own for results (the command loop's client blocks in its wait for the next step)."""

    def __init__(self, cluster: ReplicaCluster, results: dist.Store, tp_rank: int) -> None:
        self.cluster, self.results, self.tp_rank = cluster, results, tp_rank
        self._lock = threading.Lock()
        self._running: dict[str, ShardJob] = {}  # job id -> its job, while its part runs
        self._aborted: dict[str, str] = {}  # job id -> reason, for a part that has not started yet

    def run(self, job: ShardJob | ShardAbort) -> None:
        """Move this rank's shard on a thread of its own (steps go on meanwhile) and report; or fail
        a running part at once (`ShardAbort`)."""
        if isinstance(job, ShardAbort):
            self._abort(job)
            return
        with self._lock:
            self._running[job.job] = job
        threading.Thread(target=self._move, args=(job,), name=f"tp-kv-{job.job}", daemon=True).start()

    def _abort(self, abort: ShardAbort) -> None:
        with self._lock:
            job = self._running.get(abort.job)
            if job is not None:
                self._aborted[abort.job] = abort.reason
        if job is not None:  # else reported already
            threading.Thread(target=self._keep_aborting, args=(job, abort.reason), daemon=True).start()

    def _keep_aborting(self, job: ShardJob, reason: str) -> None:
        """Reset the part's streams with its peer until the part ends: a part whose data failed goes
        on to the confirmation (a new receive), which an absent peer would never answer."""
        me, peer = self.cluster.rank, job.peers[self.tp_rank]
        stream = shard_stream(me, peer) if job.direction is OpKind.SEND else shard_stream(peer, me)
        until = Deadline.after(job.seconds)
        while not until.expired():
            with self._lock:
                if job.job not in self._running:
                    return
            for s in (stream, control_stream(stream)):
                self.cluster.fabric.abort(peer, s, reason)
            time.sleep(_ABORT_POLL_S)

    def _move(self, job: ShardJob) -> None:
        error: BaseException | None = None
        try:
            self._transfer(job)
        except (TransferError, ValueError, KeyError) as exc:
            log.warning("shard %s of migration %s failed: %s", job.direction.value, job.job, exc)
            error = exc
        with self._lock:
            self._running.pop(job.job, None)
            reason = self._aborted.pop(job.job, None)
        if error is None and reason is not None:  # rank 0 failed: the migration failed, whatever this did
            error = PeerGone(f"aborted: {reason}")
        report(self.results, job.job, self.tp_rank, error)

    def _transfer(self, job: ShardJob) -> None:
        fabric, me = self.cluster.fabric, self.cluster.rank
        peer = job.peers[self.tp_rank]
        deadline = Deadline.after(job.seconds)
        options = TransferOptions(tag=job.tag)
        regions: Any = list(job.regions)
        with self._lock:
            if not regions or job.job in self._aborted:
                return
        if job.direction is OpKind.SEND:
            send_regions(fabric, peer, KV_BUFFER, regions, shard_stream(me, peer), deadline, options=options)
        else:
            recv_regions(fabric, peer, KV_BUFFER, regions, shard_stream(peer, me), deadline, options=options)

    def close(self) -> None:
        """Close the fabric."""
        self.cluster.close()
