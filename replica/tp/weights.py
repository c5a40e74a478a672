"""Per-rank weights: every weight operation of a `--tp N` replica runs on each rank over its shard.

```
 rank 0 (WeightCalls)                                   ranks r > 0 (workers)
 GroupWeights.run(job, own part) ─ Command(WEIGHTS) ──►  WeightEndpoint.run(job) on a thread: the same
   its own part over its fabric (tp_rank 0's lists)        operation over its shard, its fabric (global
   GroupReadiness: region i ready once every rank has it   rank R + r) and its lists; each landed region
     ◄──── "tp/region/<job>/<r>/<kind>:<i>" ─────────────   reported; the result under "tp/done/<job>/<r>"
```
Rank lists name the groups' ranks, tensor-parallel groups contiguous (the seeds' `src_ranks` /
`dst_ranks`); a list of the groups' rank 0s only is expanded (`group_ranks`). tp_rank t takes every
N-th of them from t: a chain `src[t]` → `dst[t::N]` (the seeds' one chain per tp_rank), a Tanz lane
set `src[t::N]` → `dst[t::N]`, p2p with the peer's rank + t. LoadParams reads each rank's slices of
the checkpoint (`WeightLayout.for_config(..., Shard(r, N))`, the rank's own layout).
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from replica.cancellation import Cancellation
from replica.errors import InvalidArgument, ReplicaError
from replica.model.layout import RegionKind
from replica.params.readiness import ParamReadiness
from replica.params.store import ParamStore
from replica.params.transfer import WeightMover
from replica.tp.group import Command, Op, TpGroup
from replica.tp.results import await_results, report
from transfer.core import Deadline
from transfer.errors import TransferError

log = logging.getLogger(__name__)
_jobs = itertools.count()
_ABORT_POLL_S = 0.05
Region = tuple[RegionKind, int]


class WeightOp(enum.Enum):
    """The weight operations a group runs per rank."""

    LOAD_DISK = "load_disk"
    SEND = "send"
    RECV = "recv"
    CHAIN = "chain"
    TANZ = "tanz"


@dataclass(frozen=True)
class WeightJob:
    """One weight operation for every rank; `sources`/`dests` as the call gave them."""

    job: str
    op: WeightOp
    sources: tuple[int, ...] = ()
    dests: tuple[int, ...] = ()
    path: str = ""
    seconds: float = 0.0

    @classmethod
    def of(cls, op: WeightOp, deadline: Deadline, sources: Sequence[int] = (), dests: Sequence[int] = (),
           path: str = "") -> WeightJob:
        """A new job (a fresh id) with the time left until `deadline`."""
        return cls(f"{time.time_ns()}-{next(_jobs)}", op, tuple(sources), tuple(dests), path,
                   deadline.remaining())


@dataclass(frozen=True)
class WeightAbort:
    """Rank 0's part of weight job `job` failed: fail the workers' parts now (not at their deadline)."""

    job: str
    reason: str


def group_ranks(ranks: Sequence[int], tp: int) -> list[int]:
    """The groups' ranks of a list: runs of `tp` contiguous ranks as they are, else each rank is a
    group's rank 0 and stands for its `tp` ranks."""
    whole = len(ranks) % tp == 0 and all(
        ranks[i + j] == ranks[i] + j for i in range(0, len(ranks), tp) for j in range(tp))
    return list(ranks) if whole and ranks else [r + t for r in ranks for t in range(tp)]


def rank_lists(sources: Sequence[int], dests: Sequence[int], tp: int,
               tp_rank: int) -> tuple[list[int], list[int]]:
    """tp_rank's sources and destinations: every `tp`-th of the groups' ranks from `tp_rank`."""
    return group_ranks(sources, tp)[tp_rank::tp], group_ranks(dests, tp)[tp_rank::tp]


def tp_chain(sources: Sequence[int], dests: Sequence[int], tp: int, tp_rank: int) -> list[int]:
    """tp_rank's chain: the source group's tp_rank, then every destination group's."""
    src, dst = rank_lists(sources, dests, tp, tp_rank)
    if len(src) != 1 or not dst:
        raise InvalidArgument(f"a chain multicast of --tp {tp} groups needs one source group and "
                              f"destinations, got {list(sources)} -> {list(dests)}")
    return [src[0], *dst]


def region_key(job: str, rank: int, region: Region) -> str:
    """Where worker `rank` reports that `region` landed during `job`."""
    return f"tp/region/{job}/{rank}/{region[0].value}:{region[1]}"


class GroupReadiness(ParamReadiness):
    """Rank 0's readiness: during a tracked fill a region becomes ready only once every rank has it
    (a rank-0 region waits for the workers' reports; the rest are settled when all finished)."""

    def __init__(self, num_layers: int, loaded: bool, store: dist.Store, world: int,
                 regions: Sequence[Region]) -> None:
        super().__init__(num_layers, loaded)
        self.store, self.world, self.regions = store, world, list(regions)
        self._lock = threading.Lock()
        self._job = ""
        self._held: set[Region] = set()

    def track(self, job: str) -> None:
        """Hold rank 0's regions of `job` until the workers report them."""
        with self._lock:
            self._job, self._held = job, set()

    def mark(self, kind: RegionKind, index: int = 0) -> None:
        with self._lock:
            job = self._job
            if job:
                self._held.add((kind, index))
        if not job:
            super().mark(kind, index)
            return
        self._flush(job)

    def _flush(self, job: str) -> None:
        with self._lock:
            held = sorted(self._held, key=lambda r: (r[0].value, r[1]))
        for region in held:
            if self.store.check([region_key(job, r, region) for r in range(1, self.world)]):
                with self._lock:
                    self._held.discard(region)
                super().mark(*region)

    def finish(self, ok: bool) -> None:
        """The tracked fill ended (every rank reported): on success mark what rank 0 still held."""
        with self._lock:
            job, held, self._job, self._held = self._job, self._held, "", set()
        if ok:
            for region in held:
                super().mark(*region)
        for region in self.regions:
            for r in range(1, self.world):
                self.store.delete_key(region_key(job, r, region))


class GroupWeights:
    """Rank 0's side: publish a weight job, run its own part, wait for every rank's result."""

    def __init__(self, group: TpGroup, readiness: GroupReadiness) -> None:
        self.group, self.readiness = group, readiness
        self.world = group.shard.world

    def run(self, job: WeightJob, own: Callable[[], None], fills: bool) -> None:
        """The job on every rank; region readiness (when this group `fills`) across the group."""
        deadline = Deadline.after(job.seconds)
        if fills:
            self.readiness.track(job.job)
        ok = False
        self.group.commands.publish(Command(Op.WEIGHTS, job))
        try:
            try:
                own()
            except BaseException as exc:
                reason = f"rank 0's part failed: {type(exc).__name__}: {exc}"
                self.group.commands.publish(Command(Op.WEIGHTS, WeightAbort(job.job, reason)))
                self._quietly(job, deadline)
                raise
            await_results(self.group.store, job.job, self.world, deadline, f"weights ({job.op.value})")
            ok = True
        finally:
            if fills:
                self.readiness.finish(ok)

    def _quietly(self, job: WeightJob, deadline: Deadline) -> None:
        """Wait for the workers of a job whose own part failed (their errors logged)."""
        try:
            await_results(self.group.store, job.job, self.world, deadline, f"weights ({job.op.value})")
        except ReplicaError as exc:
            log.info("a tensor-parallel rank's part failed too: %s", exc)


class ReportingReadiness(ParamReadiness):
    """A worker's readiness: each region landed during a job is reported to rank 0."""

    def __init__(self, num_layers: int, results: dist.Store, tp_rank: int) -> None:
        super().__init__(num_layers, loaded=False)
        self.results, self.tp_rank = results, tp_rank
        self.job = ""

    def mark(self, kind: RegionKind, index: int = 0) -> None:
        super().mark(kind, index)
        if self.job:
            self.results.set(region_key(self.job, self.tp_rank, (kind, index)), "1")


class WeightEndpoint:
    """A worker's side: its shard's store and mover over its own fabric; runs jobs on a thread."""

    def __init__(self, params: ParamStore, mover: WeightMover, results: dist.Store, tp: int,
                 tp_rank: int) -> None:
        self.params, self.mover, self.results = params, mover, results
        self.tp, self.tp_rank = tp, tp_rank
        self._lock = threading.Lock()  # one weight operation at a time (rank 0's guard holds too)
        self._cancels: dict[str, Cancellation] = {}  # job id -> its cancellation, until it reported
        self._jobs: dict[str, WeightJob] = {}  # likewise: the job
        self._cancels_lock = threading.Lock()

    def run(self, job: WeightJob | WeightAbort) -> None:
        """This rank's part of `job`, on a thread of its own (steps go on meanwhile), then report; a
        `WeightAbort` fails a running part at once (its transfers aborted)."""
        if isinstance(job, WeightAbort):
            with self._cancels_lock:
                running = self._cancels.get(job.job)
            if running is not None:  # else reported already
                running.set()
                threading.Thread(target=self._keep_aborting, args=(job,), daemon=True).start()
            return
        with self._cancels_lock:
            cancel = self._cancels.setdefault(job.job, Cancellation())
            self._jobs[job.job] = job
        threading.Thread(target=self._run, args=(job, cancel), name=f"tp-weights-{job.job}",
                         daemon=True).start()

    def _run(self, job: WeightJob, cancel: Cancellation) -> None:
        error: BaseException | None = None
        with self._lock:
            readiness = self.params.readiness
            assert isinstance(readiness, ReportingReadiness)
            readiness.job = job.job
            try:
                self._part(job, Deadline.after(job.seconds), cancel)
            except (ReplicaError, TransferError, ValueError, KeyError, OSError) as exc:
                log.warning("weights (%s) failed on this rank: %s", job.op.value, exc)
                error = exc
            finally:
                readiness.job = ""
        with self._cancels_lock:
            self._cancels.pop(job.job, None)
            self._jobs.pop(job.job, None)
        report(self.results, job.job, self.tp_rank, error)

    def _keep_aborting(self, abort: WeightAbort) -> None:
        """Reset the part's streams with its peers until it ends: a part whose data failed goes on
        to the confirmation (a new receive), which a peer that never came would never answer."""
        with self._cancels_lock:
            job = self._jobs.get(abort.job)
        if job is None:
            return
        src, dst = rank_lists(job.sources, job.dests, self.tp, self.tp_rank)
        until = Deadline.after(job.seconds)
        while not until.expired():
            with self._cancels_lock:
                if abort.job not in self._jobs:
                    return
            self.mover.abort([*src, *dst], abort.reason)
            time.sleep(_ABORT_POLL_S)

    def _part(self, job: WeightJob, deadline: Deadline, cancel: Cancellation) -> None:
        src, dst = rank_lists(job.sources, job.dests, self.tp, self.tp_rank)
        me, mover = self.mover.rank, self.mover
        fills = job.op in (WeightOp.LOAD_DISK, WeightOp.RECV) or (
            job.op in (WeightOp.CHAIN, WeightOp.TANZ) and me not in src)
        if fills:  # rank 0 checked the group's state (a fill of a complete buffer is refused there)
            self.params.readiness.reset()
        if job.op is WeightOp.LOAD_DISK:
            self.params.load_from_disk(Path(job.path))
        elif cancel.is_set():  # rank 0 failed before this part started
            raise ReplicaError(f"weights ({job.op.value}): aborted by rank 0")
        elif job.op is WeightOp.SEND:
            mover.send_to(dst[0], deadline, cancel)
        elif job.op is WeightOp.RECV:
            mover.recv_from(src[0], deadline, cancel)
        elif job.op is WeightOp.CHAIN:
            mover.chain([src[0], *dst], deadline, cancel)
        else:
            mover.tanz(src, dst, deadline, cancel)
