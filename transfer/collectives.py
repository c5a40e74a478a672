"""The entry points a replica calls: p2p, chain multicast, Tanz and ring all-gather over a fabric.

Each call moves a LIST of regions `(offset, length)` of one registered buffer as one logical
transfer (chunked; small regions are gathered into one message, large ones split), calls
`on_region(i)` on the caller's thread once region `i` is completely in place on this rank, and
returns only when every rank of the collective has everything (a final confirmation through the
leader, `ranks[0]`), or raises a `TransferError`. A failure anywhere makes every rank fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transfer.confirm import confirm
from transfer.core import Deadline, Segment, control_stream
from transfer.errors import PeerGone, TransferError
from transfer.executor import Executor, ExecutorOptions, RegionCallback
from transfer.fabric import Fabric
from transfer.plans import Plan, plan_chain, plan_p2p, plan_ring, plan_tanz
from transfer.regions import RegionMap


@dataclass(frozen=True)
class TransferOptions:
    """Chunking and pipelining knobs (both sides of a transfer must use the same `chunk_bytes`)."""

    chunk_bytes: int = 4 << 20
    window: int = 16
    stripe_bytes: int = 64 << 20  # Tanz stripe
    confirm: bool = True  # end with a completion confirmation through the leader
    tag: int = 0  # identifies this collective in the confirmation; use a new one for each retry


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
    if options.confirm:  # a collective of its own (a new tag): no earlier failure concerns it
        _refresh(fabric, plan, stream, leader)
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
        error = _confirmed(fabric, plan, stream, options.tag, error, deadline)
    if error is not None:
        raise error


def _refresh(fabric: Fabric, plan: Plan, stream: int, leader: int) -> None:
    """Replace the idle connections of this collective that a peer reset in an earlier, failed one
    (`Fabric.refresh`), so the retry's first messages do not go into them."""
    for edge in plan.peers(fabric.rank):
        fabric.refresh(edge, stream)
    confirming = [r for r in plan.ranks if r != leader] if fabric.rank == leader else [leader]
    for other in confirming:  # the confirmation records' direction
        fabric.refresh(other, control_stream(stream))


def _confirmed(
    fabric: Fabric, plan: Plan, stream: int, tag: int, error: TransferError | None, deadline: Deadline
) -> TransferError | None:
    try:
        all_ok = confirm(fabric, plan.ranks, stream, tag, error is None, deadline)
    except TransferError as exc:
        return error or exc
    if error is None and not all_ok:
        return PeerGone(f"rank {fabric.rank}: another rank of the collective {list(plan.ranks)} failed")
    return error


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
