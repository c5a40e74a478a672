"""From a plan to scaling actions: which replicas, which method (pure; the executor runs them).

Scale-up of a kind, in this order of preference (each step takes what the one before left):
1. revive a replica draining from that kind (nothing moves);
2. re-activate an idle replica that still holds weights (keep-alive);
3. mutation, when the plan is prefill down and decode up: a prefill replica becomes a decode
   replica instead of weights moving;
4. weights for inactive replicas, by the first method of the policy that applies: Tanz (≥ 2 sources,
   ≥ 2 targets, targets a multiple of the lanes), chain multicast (one source, several targets), p2p,
   and LoadParams from the model root (or the host cache) when no replica holds weights.
Sources are replicas with complete weights and no scaling action of their own, decode replicas
first (their links mostly receive KV, so sending weights out of them contends least with
migrations), then idle ones, then prefill replicas.

Scale-down: drain the least-loaded replica of the kind (at most one per round, never below the
minimum: the planner already enforced both); expiry: reset an idle replica past its keep-alive.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from router.scaling.planner import Plan, ReplicaSample, Snapshot
from router.states import HOLDS_WEIGHTS, State
from router.types import ReplicaId
from router.weights import TRANSFER_METHODS, Method


class Kind(enum.Enum):
    """The two kinds of replica a plan counts."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Revive:
    """A draining replica takes its job back."""

    replica: ReplicaId
    kind: Kind


@dataclass(frozen=True)
class Reactivate:
    """An idle replica (weights kept) serves again."""

    replica: ReplicaId
    kind: Kind


@dataclass(frozen=True)
class Mutate:
    """A prefill replica becomes a decode replica (its batches decode where they are)."""

    replica: ReplicaId


@dataclass(frozen=True)
class Load:
    """Weights into inactive `targets` by `method` from `sources` (none for LoadParams)."""

    method: Method
    sources: tuple[ReplicaId, ...]
    targets: tuple[ReplicaId, ...]
    kind: Kind
    live: bool = False  # new prefill replicas serve layer by layer while loading (zigzag)
    peers: tuple[str, ...] = ()  # HOST_PEER: replicas outside the pool sending host copies, a share each


@dataclass(frozen=True)
class Drain:
    """Scale-down: no new work; the replica idles with its weights once empty."""

    replica: ReplicaId


@dataclass(frozen=True)
class Expire:
    """Keep-alive over: the idle replica drops its weights (ResetStatus) and becomes inactive."""

    replica: ReplicaId


Action = Revive | Reactivate | Mutate | Load | Drain | Expire


@dataclass(frozen=True)
class Capabilities:
    """What a scaling policy lets the executor do."""

    methods: tuple[Method, ...]  # weight methods in order of preference
    live: bool = False  # zigzag: new prefill replicas serve while loading
    mutate: bool = True  # prefill down + decode up by mutation
    reuse_idle: bool = True  # re-activate idle replicas that kept their weights


_DRAINING_OF = {Kind.PREFILL: State.DRAINING_PREFILL, Kind.DECODE: State.DRAINING_DECODE}


def choose(plan: Plan, snapshot: Snapshot, caps: Capabilities) -> list[Action]:
    """The actions that carry out `plan` on `snapshot` (see the module docstring)."""
    free = {r.id: r for r in snapshot.replicas if r.transfers == 0}
    actions: list[Action] = []
    actions += _expire(plan, free)
    need = {Kind.PREFILL: max(plan.prefill.delta, 0), Kind.DECODE: max(plan.decode.delta, 0)}
    if caps.mutate and plan.prefill.delta < 0 and need[Kind.DECODE] > 0:
        actions += _mutate(free, need)
    elif plan.prefill.delta < 0:
        actions += _drain(free, State.PREFILL)
    if plan.decode.delta < 0:
        actions += _drain(free, State.DECODE)
    for kind in (Kind.PREFILL, Kind.DECODE):
        actions += _revive(kind, free, need)
        if caps.reuse_idle:
            actions += _reactivate(kind, free, need)
    holders = any(r.state in HOLDS_WEIGHTS for r in snapshot.replicas)
    for kind in (Kind.PREFILL, Kind.DECODE):
        actions += _load(kind, free, need, caps, holders)
    return actions


def _take(free: dict[ReplicaId, ReplicaSample], chosen: Sequence[ReplicaSample]) -> list[ReplicaId]:
    for r in chosen:
        free.pop(r.id, None)
    return [r.id for r in chosen]


def _in(free: dict[ReplicaId, ReplicaSample], *states: State) -> list[ReplicaSample]:
    return sorted((r for r in free.values() if r.state in states), key=lambda r: (r.used_pages, r.id))


def _expire(plan: Plan, free: dict[ReplicaId, ReplicaSample]) -> list[Action]:
    return [Expire(rid) for rid in _take(free, [free[rid] for rid in plan.expire if rid in free])]


def _mutate(free: dict[ReplicaId, ReplicaSample], need: dict[Kind, int]) -> list[Action]:
    prefills = _in(free, State.PREFILL)
    if not prefills:
        return []
    need[Kind.DECODE] -= 1
    return [Mutate(rid) for rid in _take(free, prefills[:1])]


def _drain(free: dict[ReplicaId, ReplicaSample], state: State) -> list[Action]:
    return [Drain(rid) for rid in _take(free, _in(free, state)[:1])]


def _revive(kind: Kind, free: dict[ReplicaId, ReplicaSample], need: dict[Kind, int]) -> list[Action]:
    # most-loaded first: the one with the most work left gains most from taking its job back
    chosen = _in(free, _DRAINING_OF[kind])[::-1][:need[kind]]
    need[kind] -= len(chosen)
    return [Revive(rid, kind) for rid in _take(free, chosen)]


def _reactivate(kind: Kind, free: dict[ReplicaId, ReplicaSample], need: dict[Kind, int]) -> list[Action]:
    chosen = _in(free, State.IDLE)[:need[kind]]
    need[kind] -= len(chosen)
    return [Reactivate(rid, kind) for rid in _take(free, chosen)]


_QUIET_SOURCES = {State.DECODE: 0, State.DRAINING_DECODE: 1, State.IDLE: 2, State.DRAINING_PREFILL: 3}


def _sources(free: dict[ReplicaId, ReplicaSample]) -> list[ReplicaSample]:
    """Replicas that can send weights, in order of preference (see the module docstring); replicas
    that prefill (their links carry the KV going out) only when no other one can."""
    holders = [r for r in free.values() if r.state in HOLDS_WEIGHTS]
    quiet = [r for r in holders if r.state in _QUIET_SOURCES] or holders
    return sorted(quiet, key=lambda r: (_QUIET_SOURCES.get(r.state, 4), r.used_pages, r.id))


def _load(kind: Kind, free: dict[ReplicaId, ReplicaSample], need: dict[Kind, int],
          caps: Capabilities, holders: bool) -> list[Action]:
    """Weights for inactive replicas; LoadParams only by a policy that has no other method, or
    when no replica of the cluster holds weights (busy sources make the targets wait a round)."""
    targets = _in(free, State.INACTIVE)
    if not targets or need[kind] <= 0:
        return []
    # weights move shard t to tp_rank t: sources and targets of one group size (the first target's);
    # when only groups of other sizes could send, the targets load from storage
    size = targets[0].tp
    targets = [t for t in targets if t.tp == size][:need[kind]]
    others = _sources(free)
    sources = [s for s in others if s.tp == size]
    holders = holders and (bool(sources) or not others)
    live = caps.live and kind is Kind.PREFILL
    transfers = any(m in TRANSFER_METHODS for m in caps.methods)
    for method in caps.methods:
        if method not in TRANSFER_METHODS and transfers and holders:
            continue
        picked = _fit(method, sources, targets)
        if picked is None:
            continue
        srcs, dsts = picked
        need[kind] -= len(dsts)
        _take(free, dsts)
        return [Load(method, tuple(_take(free, srcs)), tuple(r.id for r in dsts), kind, live)]
    return []


def _fit(method: Method, sources: list[ReplicaSample], targets: list[ReplicaSample]
         ) -> tuple[list[ReplicaSample], list[ReplicaSample]] | None:
    """The sources and targets `method` would use, or None when it does not apply."""
    if method is Method.HOST_PEER:  # needs a peer outside the pool: only a wake picks it (models.py)
        return None
    if method not in TRANSFER_METHODS:
        return [], targets
    if not sources:
        return None
    if method is Method.TANZ:
        lanes = max((n for n in range(2, len(sources) + 1) if len(targets) % n == 0), default=0)
        return (sources[:lanes], targets) if lanes and len(targets) >= 2 else None
    if method is Method.CHAIN:
        return (sources[:1], targets) if len(targets) >= 2 else None
    return sources[:len(targets)], targets  # p2p: one source per target, round robin if fewer
