"""Moving weights into replicas that have none: the methods, and what a failure leaves behind.

```
 p2p        RecvParams(src) on the target, then SendParams(dst) on a source, then WaitRdmaDone on both
 chain      RdmaBroadcast([src], targets) on every member (the chain's tail first), then WaitRdmaDone on all
 tanz       TanzBroadcast(sources, targets) on every member (blocking; |targets| % |sources| == 0)
            (every transfer call names the model: sources holding another refuse, receivers record it)
 load_disk  LoadParams(LOAD_FROM_DISK, model) on each target (blocking)
 load_host  LoadParams(LOAD_FROM_HOST_MEM) on each target (blocking)
 host_peer  RecvParams(src, more_srcs) on the target, then SendParams(dst, host_copy_model, share i
            of n) on each source (replicas of other pools or spares whose host memory holds the model),
            WaitRdmaDone on all
```
`become_ready` gives targets whose weights are complete their role. Used by the operator's
ActivateReplica (`control.py`) and by the autoscaler's executor (`scaling/executor.py`). A failed
transfer first waits (at most `SETTLE_S`) for every live member's background part to end, so a
retry finds no parameter operation in flight, then raises.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Sequence
from typing import Protocol

from router.errors import ReplicaCallError
from router.registry import ReplicaHandle
from router.replica_api import ReplicaApi
from router.replicas import State, TransitionError, Trigger
from router.types import ReplicaId

log = logging.getLogger("pdcluster.router")


class Method(enum.Enum):
    """How weights reach replicas that have none."""

    TANZ = "tanz"
    CHAIN = "chain"
    P2P = "p2p"
    LOAD_DISK = "load_disk"  # LoadParams from the model root
    LOAD_HOST = "load_host"  # LoadParams from the node's host-memory copy
    HOST_PEER = "host_peer"  # another replica's host-memory copy over the network (SendParams)


TRANSFER_METHODS = (Method.TANZ, Method.CHAIN, Method.P2P)  # from replicas that hold weights
LOAD_METHODS = (Method.LOAD_DISK, Method.LOAD_HOST)  # from storage, no source replica

# How long a failed transfer waits for the members' background parts before raising. A member
# waiting for a peer that died before connecting only fails at its own deadline: the caller does
# not wait for that; a retry meanwhile is refused FAILED_PRECONDITION ("another parameter
# operation is in flight") until it ends.
SETTLE_S = 30.0


class Member(Protocol):
    """A replica taking part in a weight transfer."""

    @property
    def rank(self) -> int:
        """Its global rank (rank 0 of its tensor-parallel group)."""
        ...

    @property
    def ranks(self) -> tuple[int, ...]:
        """Its group's global ranks, one per tp_rank."""
        ...

    @property
    def client(self) -> ReplicaApi:
        """Its client."""
        ...

    @property
    def alive(self) -> bool:
        """Not declared dead."""
        ...

    @property
    def layout(self) -> str:
        """The model its weight buffer is laid out for (Info: what it holds or last held, else the
        checkpoint it started with)."""
        ...


async def move(method: Method, sources: Sequence[Member], targets: Sequence[Member], model: str = "") -> None:
    """Give every target the weights by `method`; on failure settle the members, then raise."""
    if not targets:
        raise ValueError("no replica to give weights to")
    if (method in TRANSFER_METHODS or method is Method.HOST_PEER) and not sources:
        raise ValueError(f"{method.value} needs a source replica that holds the weights")
    try:
        await _RUN[method](sources, targets, model)
    except BaseException:
        # parts in the background (a Tanz may run as a chain, `_tanz`): join them
        if method in (Method.P2P, Method.CHAIN, Method.TANZ, Method.HOST_PEER):
            await settle([*sources, *targets])
        raise


async def _all(*calls: Awaitable[object]) -> None:
    """Run the calls together; on the first failure cancel the others (a replica whose call is
    cancelled aborts its part and frees its parameter operation at once), then raise it."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _p2p(sources: Sequence[Member], targets: Sequence[Member], model: str) -> None:
    """One source per target (round robin); a source sends to its targets one after another (a
    replica runs one parameter operation at a time), the sources in parallel."""
    share: dict[int, tuple[Member, list[Member]]] = {}
    for i, t in enumerate(targets):
        src = sources[i % len(sources)]
        share.setdefault(src.rank, (src, []))[1].append(t)
    await _all(*(_send_each(src, dsts, model) for src, dsts in share.values()))


async def _send_each(src: Member, targets: list[Member], model: str, host_copy: bool = False) -> None:
    for dst in targets:  # the receiver's call first: it answers once laid out for `model` (a spare
        # of another shape switches), so the sender's connection meets the right handshake
        await dst.client.recv_params(src.rank, model)
        await src.client.send_params(dst.rank, model, host_copy=host_copy)
        await _all(src.client.wait_rdma_done(), dst.client.wait_rdma_done())


async def _host_peer(sources: Sequence[Member], targets: Sequence[Member], model: str) -> None:
    """The sources' host-memory copies of `model` to every target, one target after another, each
    source sending its share of the regions at once (one source: all of them). Each source's Info is
    asked first: one whose host memory lacks the model (an Info read earlier may be stale) fails the
    move before any target starts a receive that would wait out its deadline for it."""
    await _all(*(_holds_host_copy(s, model) for s in sources))
    if len(sources) == 1:
        await _send_each(sources[0], list(targets), model, host_copy=True)
        return
    n = len(sources)
    for dst in targets:
        await dst.client.recv_params(sources[0].rank, model, more_srcs=[s.rank for s in sources[1:]])
        for i, src in enumerate(sources):
            await src.client.send_params(dst.rank, model, host_copy=True, share=i, shares=n)
        await _all(*(s.client.wait_rdma_done() for s in sources), dst.client.wait_rdma_done())


async def _holds_host_copy(source: Member, model: str) -> None:
    """TransitionError unless `source`'s host memory holds a copy of `model` now (its Info)."""
    copies = [name for name, _ in (await source.client.info()).host_copies]
    if model not in copies:
        raise TransitionError(f"replica {source.client.address}'s host memory holds no copy of {model} "
                              f"(its host copies: {', '.join(copies) or 'none'})")


async def _chain(sources: Sequence[Member], targets: Sequence[Member], model: str) -> None:
    """Chain multicast source → t1 → t2 …: every member starts its part, then all join. Every rank of
    every group is named (the groups contiguous): tp_rank t's chain is `[src_ranks[t]] +
    dst_ranks[t::tp]`, shard t of the source down rank t of each target. The parts start from the
    chain's tail: each call answers once its member is laid out for `model` (a spare of another
    shape switches), so every connection from the member before it meets the right handshake."""
    source = sources[0]
    members = [source, *targets]
    src_ranks, dst_ranks = list(source.ranks), _group_ranks(targets)
    for member in reversed(members):
        await member.client.rdma_broadcast(src_ranks, dst_ranks, model)
    await _all(*(m.client.wait_rdma_done() for m in members))


async def _tanz(sources: Sequence[Member], targets: Sequence[Member], model: str) -> None:
    """Every source feeds its lane of targets a stripe; the targets ring-exchange the stripes. Its
    members' calls run at once and each blocks to the end, so a target that must first be laid out
    for another model could meet a peer's connection before it switched: such a load runs as a
    chain from the first source instead (its parts start at the tail, each once laid out)."""
    if model and any(t.layout != model for t in targets):
        log.info("Tanz into replicas laid out for another model than %s: a chain instead", model)
        await _chain(sources[:1], targets, model)
        return
    if len(targets) % len(sources):
        raise ValueError(f"Tanz needs the targets ({len(targets)}) in equal lanes of the sources "
                         f"({len(sources)})")
    src_ranks, dst_ranks = _group_ranks(sources), _group_ranks(targets)
    await _all(*(m.client.tanz_broadcast(src_ranks, dst_ranks, model) for m in [*sources, *targets]))


def _group_ranks(members: Sequence[Member]) -> list[int]:
    """The members' global ranks, each tensor-parallel group's contiguous (the broadcasts' order)."""
    return [rank for m in members for rank in m.ranks]


async def _load_disk(_sources: Sequence[Member], targets: Sequence[Member], model: str) -> None:
    await _all(*(t.client.load_params(from_host=False, model=model) for t in targets))


async def _load_host(_sources: Sequence[Member], targets: Sequence[Member], model: str) -> None:
    await _all(*(_host_or_disk(t, model) for t in targets))


async def _host_or_disk(target: Member, model: str) -> None:
    """LoadParams from host memory; on a host-cache miss (FAILED_PRECONDITION: the node's host cache
    does not hold the model, `--host-cache-bytes`) from the model root, as ServerlessLLM does."""
    try:
        await target.client.load_params(from_host=True, model=model)
    except ReplicaCallError as exc:
        if exc.code != "FAILED_PRECONDITION" or "host cache miss" not in exc.details:
            raise
        log.info("replica %s: host cache miss, loading %s from disk", target.rank, model)
        await target.client.load_params(from_host=False, model=model)


_RUN = {Method.P2P: _p2p, Method.CHAIN: _chain, Method.TANZ: _tanz, Method.LOAD_DISK: _load_disk,
        Method.LOAD_HOST: _load_host, Method.HOST_PEER: _host_peer}


async def settle(members: Sequence[Member]) -> None:
    """After a failed transfer: wait (up to `SETTLE_S`) until every live member's background part
    has ended, so that a retry finds no operation in flight."""
    live = [m for m in members if m.alive]
    joins = asyncio.gather(*(m.client.wait_rdma_done() for m in live), return_exceptions=True)
    try:
        await asyncio.wait_for(joins, SETTLE_S)
    except TimeoutError:
        log.warning("a weight transfer failed and some members are still transferring after %.0f s",
                    SETTLE_S)


class Mortician(Protocol):
    """Who declares replicas dead."""

    def mark_dead(self, rid: ReplicaId, reason: str) -> None:
        """The replica is gone: stop its loop and re-run every request it held."""
        ...


async def become_ready(hub: Mortician, targets: Sequence[ReplicaHandle], role: State) -> None:
    """Give every target that reports its weights loaded its role; one that cannot be reached any
    more is dead. Raise naming the targets that did not become ready (the others serve)."""
    failed: list[str] = []
    for t in targets:
        try:
            info = await t.client.info()
        except ReplicaCallError as exc:
            hub.mark_dead(t.id, f"unreachable right after its weights arrived: {exc}")
            failed.append(f"replica {t.id} is unreachable (marked dead)")
            continue
        if not info.loaded:
            failed.append(f"replica {t.id} reports its weights are not loaded after the transfer")
            continue
        t.state.info = info
        t.state.move(role, Trigger.LOADED)
        log.info("replica %s activated as %s", t.id, role.value)
    if failed:
        ready = [t.id for t in targets if t.state.role is role]
        raise TransitionError("; ".join(failed) + (f" (activated: {ready})" if ready else ""))
