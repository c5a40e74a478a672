"""The workers' answers to rank 0's jobs (a KV migration's shard, a weight operation), via the
group's store: worker r sets "tp/done/<job>/<r>" to "ok" or "<kind>|<why>"; rank 0 polls for every
worker's key (a blocking wait would hold its store client's lock, through which the engine thread
publishes steps), with the job's deadline plus a grace for the report, and maps a failure back to
the status it had on the worker (timeout, peer gone, layout mismatch)."""

from __future__ import annotations

import time

import torch.distributed as dist

from replica.errors import (
    FailedPrecondition,
    InvalidArgument,
    PeerTimeout,
    PeerUnavailable,
    ReplicaError,
    Status,
)
from transfer.core import Deadline
from transfer.errors import FabricClosed, LayoutMismatch, PeerGone
from transfer.errors import PeerTimeout as TransferTimeout

REPORT_GRACE_S = 2.0  # a worker's result may arrive this long after the job's deadline
_POLL_S = 0.002
_KINDS: dict[str, type[ReplicaError]] = {"timeout": PeerTimeout, "gone": PeerUnavailable,
                                         "layout": FailedPrecondition, "precondition": FailedPrecondition,
                                         "invalid": InvalidArgument}
_STATUS_KINDS = {Status.DEADLINE_EXCEEDED: "timeout", Status.UNAVAILABLE: "gone",
                 Status.FAILED_PRECONDITION: "precondition", Status.INVALID_ARGUMENT: "invalid"}


def result_key(job: str, rank: int) -> str:
    """Where worker `rank` reports job `job`."""
    return f"tp/done/{job}/{rank}"


def kind_of(exc: BaseException) -> str:
    """The result kind of a worker's failure (rank 0 maps it back to a status)."""
    if isinstance(exc, TransferTimeout):
        return "timeout"
    if isinstance(exc, LayoutMismatch):
        return "layout"
    if isinstance(exc, PeerGone | FabricClosed):
        return "gone"
    if isinstance(exc, ReplicaError):  # a worker's mover maps transfer errors to these already
        return _STATUS_KINDS.get(exc.status, "error")
    return "error"


def report(store: dist.Store, job: str, rank: int, error: BaseException | None) -> None:
    """(Worker) job `job` is done here: ok, or failed with `error`."""
    result = "ok" if error is None else f"{kind_of(error)}|{type(error).__name__}: {error}"
    store.set(result_key(job, rank), result)


def await_results(store: dist.Store, job: str, world: int, deadline: Deadline, what: str) -> None:
    """(Rank 0) every worker's result of `job`; the first failure raised as its status."""
    keys = [result_key(job, r) for r in range(1, world)]
    late = Deadline.after(deadline.remaining() + REPORT_GRACE_S)
    while not store.check(keys):
        if late.expired():
            raise PeerTimeout(f"{what}: a tensor-parallel rank did not report its part in time")
        time.sleep(_POLL_S)
    results = [store.get(key).decode() for key in keys]
    for key in keys:
        store.delete_key(key)
    for rank, result in enumerate(results, start=1):
        if result != "ok":
            kind, _, why = result.partition("|")
            raise _KINDS.get(kind, ReplicaError)(f"{what}: tensor-parallel rank {rank}: {why}")
