"""The entry points a replica calls: p2p, chain multicast, Tanz and ring all-gather over a fabric.

Each call moves a LIST of regions `(offset, length)` of one registered buffer as one logical
transfer (chunked; small regions are gathered into one message, large ones split), calls
`on_region(i)` on the caller's thread once region `i` is completely in place on this rank, and
returns only when every rank of the collective has everything (a final confirmation through the
leader, `ranks[0]`), or raises a `TransferError`. A failure anywhere makes every rank fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.core import Deadline, Handle, Rank, Segment, control_stream
from transfer.errors import PeerGone, TransferError
from transfer.executor import Executor, ExecutorOptions, RegionCallback
from transfer.fabric import Fabric
from transfer.plans import Plan, plan_chain, plan_p2p, plan_ring, plan_tanz
from transfer.regions import RegionMap

_OK, _FAILED = 1, 2
_confirm_ids = itertools.count()


@dataclass(frozen=True)
class TransferOptions:
    """Chunking and pipelining knobs (both sides of a transfer must use the same `chunk_bytes`)."""

    chunk_bytes: int = 1 << 20
    window: int = 16
    stripe_bytes: int = 64 << 20  # Tanz stripe
    confirm: bool = True  # end with a completion confirmation through the leader


def run_plan(
    fabric: Fabric,
    plan: Plan,
    buffer: str,
    regions: Sequence[Segment],
    stream: int,
    deadline: Deadline,
    on_region: RegionCallback | None = None,
    options: TransferOptions | None = None,
) -> None:
    """Run this rank's part of `plan`; raise if this rank or (with `confirm`) any rank failed."""
    options = options or TransferOptions()
    leader = plan.ranks[0]
    if options.confirm and fabric.rank != leader:
        fabric.connect(leader, control_stream(stream), deadline)  # early: the leader sees our death
    executor = Executor(
        fabric, plan, buffer, RegionMap.build(regions), stream, deadline, on_region,
        ExecutorOptions(window=options.window),
    )
    error: TransferError | None = None
    try:
        executor.run()
    except TransferError as exc:
        error = exc
    if options.confirm and not deadline.expired():
        error = _confirmed(fabric, plan.ranks, stream, error, deadline)
    if error is not None:
        raise error


def _confirmed(
    fabric: Fabric, ranks: Sequence[Rank], stream: int, error: TransferError | None, deadline: Deadline
) -> TransferError | None:
    try:
        all_ok = confirm(fabric, ranks, stream, error is None, deadline)
    except TransferError as exc:
        return error or exc
    if error is None and not all_ok:
        return PeerGone(f"rank {fabric.rank}: another rank of the collective {list(ranks)} failed")
    return error


def confirm(fabric: Fabric, ranks: Sequence[Rank], stream: int, ok: bool, deadline: Deadline) -> bool:
    """Gather every rank's status at `ranks[0]` and hand back the verdict (True: all succeeded)."""
    ctl = control_stream(stream)
    name = f"__confirm:{stream}:{next(_confirm_ids)}"
    status = bytearray(len(ranks))
    fabric.register(name, status)
    try:
        if fabric.rank == ranks[0]:
            return _lead(fabric, ranks, name, status, ok, ctl, deadline)
        status[0] = _OK if ok else _FAILED
        sent = fabric.send(ranks[0], name, [(0, 1)], ctl, deadline)
        got = fabric.recv(ranks[0], name, [(1, 1)], ctl, deadline)
        try:
            sent.wait(deadline)
            got.wait(deadline)
        except TransferError as exc:
            fabric.abort(ranks[0], ctl, str(exc))  # keep the control channel aligned for the next call
            raise
        return status[1] == _OK
    finally:
        fabric.unregister(name)


def _lead(
    fabric: Fabric, ranks: Sequence[Rank], name: str, status: bytearray, ok: bool, ctl: int,
    deadline: Deadline,
) -> bool:
    handles = [(r, fabric.recv(r, name, [(i, 1)], ctl, deadline)) for i, r in enumerate(ranks) if i]
    all_ok = ok
    for rank, handle in handles:
        try:
            handle.wait(deadline)
        except TransferError as exc:
            all_ok = False  # a dead or stalled rank: the others must hear that the collective failed
            fabric.abort(rank, ctl, str(exc))
    all_ok = all_ok and all(status[i] == _OK for i in range(1, len(ranks)))
    status[0] = _OK if all_ok else _FAILED
    replies: list[Handle] = [fabric.send(r, name, [(0, 1)], ctl, deadline) for r in ranks[1:]]
    for rank, reply in zip(ranks[1:], replies, strict=True):
        try:
            reply.wait(deadline)
        except TransferError as exc:
            fabric.abort(rank, ctl, str(exc))  # that rank is gone; it already fails on its own
    return all_ok


def send_regions(
    fabric: Fabric, peer: int, buffer: str, regions: Sequence[Segment], stream: int, deadline: Deadline,
    on_region: RegionCallback | None = None, options: TransferOptions | None = None,
) -> None:
    """Send `regions` of `buffer` to `peer` (who calls `recv_regions` with equal region lengths)."""
    options = options or TransferOptions()
    plan = plan_p2p(fabric.rank, peer, _total(regions), options.chunk_bytes)
    run_plan(fabric, plan, buffer, regions, stream, deadline, on_region, options)


def recv_regions(
    fabric: Fabric, peer: int, buffer: str, regions: Sequence[Segment], stream: int, deadline: Deadline,
    on_region: RegionCallback | None = None, options: TransferOptions | None = None,
) -> None:
    """Receive from `peer` into `regions` of `buffer` (offsets may differ from the sender's)."""
    options = options or TransferOptions()
    plan = plan_p2p(peer, fabric.rank, _total(regions), options.chunk_bytes)
    run_plan(fabric, plan, buffer, regions, stream, deadline, on_region, options)


def chain_broadcast(
    fabric: Fabric, ranks: Sequence[int], buffer: str, regions: Sequence[Segment], stream: int,
    deadline: Deadline, on_region: RegionCallback | None = None, options: TransferOptions | None = None,
) -> None:
    """Chain multicast from `ranks[0]` down the chain; every rank of the chain calls this."""
    options = options or TransferOptions()
    _member(fabric, ranks)
    plan = plan_chain(ranks, _total(regions), options.chunk_bytes)
    run_plan(fabric, plan, buffer, regions, stream, deadline, on_region, options)


def tanz_broadcast(
    fabric: Fabric, sources: Sequence[int], dests: Sequence[int], buffer: str, regions: Sequence[Segment],
    stream: int, deadline: Deadline, on_region: RegionCallback | None = None,
    options: TransferOptions | None = None,
) -> None:
    """Tanz: every source holds the buffer; lanes of dests get stripes, then ring-exchange them."""
    options = options or TransferOptions()
    _member(fabric, [*sources, *dests])
    plan = plan_tanz(sources, dests, _total(regions), options.stripe_bytes, options.chunk_bytes)
    run_plan(fabric, plan, buffer, regions, stream, deadline, on_region, options)


def ring_allgather(
    fabric: Fabric, ranks: Sequence[int], buffer: str, regions: Sequence[Segment], stream: int,
    deadline: Deadline, on_region: RegionCallback | None = None, options: TransferOptions | None = None,
) -> None:
    """Ring all-gather: rank i of `ranks` holds stripe i of the logical bytes; afterwards all do."""
    options = options or TransferOptions()
    _member(fabric, ranks)
    plan = plan_ring(ranks, _total(regions), options.chunk_bytes)
    run_plan(fabric, plan, buffer, regions, stream, deadline, on_region, options)


def _total(regions: Sequence[Segment]) -> int:
    return sum(length for _, length in regions)


def _member(fabric: Fabric, ranks: Sequence[int]) -> None:
    if fabric.rank not in ranks:
        raise ValueError(f"rank {fabric.rank} is not part of the collective {list(ranks)}")
