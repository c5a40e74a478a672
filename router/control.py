"""Operator actions on replicas: role changes, draining, activation of inactive replicas.

Called by the admin service; each validates against the role state machine and raises
`TransitionError` (→ FAILED_PRECONDITION), `KeyError` (→ NOT_FOUND) or `ReplicaCallError`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.errors import ReplicaCallError
from router.registry import ReplicaHandle
from router.replicas import SERVING, Role, TransitionError
from router.types import ReplicaId

if TYPE_CHECKING:
    from router.scheduler import ClusterScheduler

log = logging.getLogger("pdcluster.router")


class ActivationMethod(enum.Enum):
    """How weights reach inactive replicas."""

    P2P = "p2p"
    CHAIN = "chain"


def handle_of(hub: ClusterScheduler, rid: int) -> ReplicaHandle:
    """The replica with this id (KeyError when unknown)."""
    return hub.replicas[ReplicaId(rid)]


async def set_role(hub: ClusterScheduler, rid: int, role: Role) -> None:
    """Change a replica's role; prefill → decode is a mutation (its batches stay and decode there)."""
    handle = handle_of(hub, rid)
    old = handle.state.role
    if old is role:
        return
    if role is Role.DECODE and old is Role.PREFILL:
        handle.state.set_role(Role.MUTATING_TO_DECODE)
    elif role is Role.PREFILL and old in (Role.DECODE, Role.COLOCATED) and not handle.empty:
        raise TransitionError(f"replica {rid} still holds requests: drain it before making it prefill")
    elif role is Role.INACTIVE and old is Role.IDLE:
        await handle.client.reset_status()
    handle.state.set_role(role)
    log.info("replica %s: %s -> %s", rid, old.value, role.value)
    hub.notify()


def drain(hub: ClusterScheduler, rid: int) -> None:
    """Give the replica no new work; its loop finishes what it holds, then it becomes IDLE."""
    handle = handle_of(hub, rid)
    handle.state.set_role(Role.DRAINING)
    hub.settle_roles()
    hub.notify()


def default_sources(hub: ClusterScheduler) -> list[ReplicaHandle]:
    """Loaded live replicas that can send weights, serving ones first."""
    loaded = [h for h in hub.replicas.values() if h.state.alive and h.state.info.loaded
              and h.state.role not in (Role.INACTIVE, Role.LOADING)]
    return sorted(loaded, key=lambda h: (h.state.role not in SERVING, h.id))


async def activate(hub: ClusterScheduler, target_ids: Sequence[int], role: Role,
                   method: ActivationMethod | None, source_ids: Sequence[int] = ()) -> float:
    """Load weights into inactive replicas from loaded ones, then give them `role`; returns seconds."""
    targets = [handle_of(hub, i) for i in target_ids]
    if not targets:
        raise ValueError("no replica to activate")
    sources = [handle_of(hub, i) for i in source_ids] or default_sources(hub)[:1]
    if not sources:
        raise TransitionError("no loaded replica to send weights from")
    for t in targets:
        if t.state.role is not Role.INACTIVE:
            raise TransitionError(f"replica {t.id} is {t.state.role.value}, not inactive")
    method = method or (ActivationMethod.CHAIN if len(targets) > 1 else ActivationMethod.P2P)
    for t in targets:
        t.state.set_role(Role.LOADING)
    t0 = hub.clock()
    try:
        try:
            if method is ActivationMethod.P2P:
                await _p2p(sources, targets)
            else:
                await _chain(sources[0], targets)
        except BaseException:
            await _settle([*sources, *targets])
            raise
        await _become_ready(hub, targets, role)
    except BaseException:
        for t in targets:
            if t.state.role is Role.LOADING:
                t.state.set_role(Role.INACTIVE)
        raise
    hub.notify()
    return hub.clock() - t0


async def _p2p(sources: list[ReplicaHandle], targets: list[ReplicaHandle]) -> None:
    """One source per target (round robin); a source sends to its targets one after another (a
    replica runs one parameter operation at a time), the sources in parallel."""
    share: dict[int, tuple[ReplicaHandle, list[ReplicaHandle]]] = {}
    for i, t in enumerate(targets):
        src = sources[i % len(sources)]
        share.setdefault(src.id, (src, []))[1].append(t)
    await asyncio.gather(*(_send_each(src, dsts) for src, dsts in share.values()))


async def _send_each(src: ReplicaHandle, targets: list[ReplicaHandle]) -> None:
    for dst in targets:
        await asyncio.gather(src.client.send_params(dst.rank), dst.client.recv_params(src.rank))
        await asyncio.gather(src.client.wait_rdma_done(), dst.client.wait_rdma_done())


# How long a failed activation waits for the members' background parts before answering. A member
# waiting for a peer that died before connecting only fails at its own deadline (minutes): the
# admin call does not wait for that; a retry meanwhile is refused FAILED_PRECONDITION ("another
# parameter operation is in flight") until it ends.
SETTLE_S = 30.0


async def _settle(members: list[ReplicaHandle]) -> None:
    """After a failed transfer: wait (up to `SETTLE_S`) until every live member's background part
    has ended, so that a retry finds no operation in flight."""
    live = {h.id: h for h in members if h.state.alive}
    joins = asyncio.gather(*(h.client.wait_rdma_done() for h in live.values()), return_exceptions=True)
    try:
        await asyncio.wait_for(joins, SETTLE_S)
    except TimeoutError:
        log.warning("activation failed and some members are still transferring after %.0f s", SETTLE_S)


async def _chain(source: ReplicaHandle, targets: list[ReplicaHandle]) -> None:
    """Chain multicast source → t1 → t2 …: every member starts its part, then all join."""
    members = [source, *targets]
    src_ranks, dst_ranks = [source.rank], [t.rank for t in targets]
    await asyncio.gather(*(m.client.rdma_broadcast(src_ranks, dst_ranks) for m in members))
    await asyncio.gather(*(m.client.wait_rdma_done() for m in members))


async def _become_ready(hub: ClusterScheduler, targets: list[ReplicaHandle], role: Role) -> None:
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
        t.state.set_role(role)
        log.info("replica %s activated as %s", t.id, role.value)
    if failed:
        ready = [t.id for t in targets if t.state.role is role]
        raise TransitionError("; ".join(failed) + (f" (activated: {ready})" if ready else ""))
