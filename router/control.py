"""Operator actions on replicas: role changes, draining, activation of inactive replicas.

Called by the admin service; each validates against the transition table (`router/states.py`)
and raises `TransitionError` (→ FAILED_PRECONDITION), `KeyError` (→ NOT_FOUND) or
`ReplicaCallError`. Weights move by `router/weights.py`, as the autoscaler's do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from router import weights
from router.registry import ReplicaHandle
from router.replicas import State, TransitionError, Trigger
from router.states import HOLDS_WEIGHTS, SERVING, triggers
from router.types import ReplicaId
from router.weights import Method

if TYPE_CHECKING:
    from router.scheduler import ClusterScheduler

log = logging.getLogger("pdcluster.router")

# The operator's role changes, by the trigger they count as (when the table allows several).
_OPERATOR_TRIGGERS = (Trigger.REACTIVATE, Trigger.EXPIRE, Trigger.ASSIGN)


def handle_of(hub: ClusterScheduler, rid: int) -> ReplicaHandle:
    """The replica with this id (KeyError when unknown)."""
    return hub.replicas[ReplicaId(rid)]


async def set_role(hub: ClusterScheduler, rid: int, role: State) -> None:
    """Change a replica's role; prefill → decode is a mutation (its batches stay and decode there)."""
    handle = handle_of(hub, rid)
    old = handle.state.role
    if old is role:
        return
    if role is State.DECODE and old is State.PREFILL:
        handle.state.move(State.MUTATING_TO_DECODE, Trigger.MUTATE)
        handle.state.move(State.DECODE, Trigger.MUTATED)
    else:
        if role is State.PREFILL and old in (State.DECODE, State.COLOCATED) and not handle.empty:
            raise TransitionError(f"replica {rid} still holds requests: drain it before making it prefill")
        trigger = next((t for t in _OPERATOR_TRIGGERS if t in triggers(old, role)), Trigger.ASSIGN)
        if trigger is Trigger.EXPIRE:
            await handle.client.reset_status()
        handle.state.move(role, trigger)
    log.info("replica %s: %s -> %s", rid, old.value, role.value)
    hub.notify()


def drain(hub: ClusterScheduler, rid: int) -> None:
    """Give the replica no new work; its loop finishes what it holds, then it becomes IDLE."""
    handle = handle_of(hub, rid)
    prefill = handle.state.role in (State.PREFILL, State.OLD_PREFILL)
    handle.state.move(State.DRAINING_PREFILL if prefill else State.DRAINING_DECODE, Trigger.DRAIN)
    hub.settle_roles()
    hub.notify()


def default_sources(hub: ClusterScheduler) -> list[ReplicaHandle]:
    """Loaded live replicas that can send weights, serving ones first."""
    loaded = [h for h in hub.replicas.values() if h.state.info.loaded and h.state.role in HOLDS_WEIGHTS]
    return sorted(loaded, key=lambda h: (h.state.role not in SERVING, h.id))


def loading_state(role: State) -> tuple[State, Trigger]:
    """The state (and its trigger) of a replica loading weights to take `role`."""
    if role is State.DECODE:
        return State.LOADING_DECODE, Trigger.LOAD_DECODE
    if role in (State.PREFILL, State.COLOCATED):
        return State.LOADING_PREFILL, Trigger.LOAD_PREFILL
    raise ValueError(f"replicas are activated as prefill, decode or colocated, not {role.value}")


async def activate(hub: ClusterScheduler, target_ids: Sequence[int], role: State,
                   method: Method | None, source_ids: Sequence[int] = (),
                   peers: Sequence[weights.Member] = ()) -> float:
    """Load weights into inactive replicas, then give them `role`; returns seconds. `Method.HOST_PEER`
    sends from `peers` (replicas of any model holding a host copy, held by the caller), not from
    `source_ids`."""
    targets = [handle_of(hub, i) for i in target_ids]
    if not targets:
        raise ValueError("no replica to activate")
    loading, trigger = loading_state(role)
    method = method or (Method.CHAIN if len(targets) > 1 else Method.P2P)
    sources: list[weights.Member] = list(peers) if method is Method.HOST_PEER else \
        [handle_of(hub, i) for i in source_ids]
    if method is Method.HOST_PEER and not sources:
        raise TransitionError(f"no replica holds a host copy of {hub.model_name} to send")
    if method in weights.TRANSFER_METHODS:
        sources = sources or list[weights.Member](default_sources(hub)[:1])
        if not sources:
            raise TransitionError("no loaded replica to send weights from")
    for t in targets:
        if t.state.role is not State.INACTIVE:
            raise TransitionError(f"replica {t.id} is {t.state.role.value}, not inactive")
    for t in targets:
        t.state.move(loading, trigger)
    t0 = hub.clock()
    try:
        await weights.move(method, sources, targets, hub.model_name)
        await weights.become_ready(hub, targets, role)
    except BaseException:
        for t in targets:
            if t.state.role is loading:
                t.state.move(State.INACTIVE, Trigger.LOAD_FAILED)
        raise
    hub.notify()
    return hub.clock() - t0
