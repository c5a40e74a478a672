"""Replica roles, the role state machine, page accounting and heartbeat expiry (pure Python).

Every role change goes through `ReplicaState.set_role`, checked against the one table `_ALLOWED`
(a dead replica comes back only through `revive`); `snapshot()` is a frozen copy of the state for
readers that must not change it (the admin service, a planner).

```
 INACTIVE ─► LOADING ─► PREFILL ─► MUTATING_TO_DECODE ─► DECODE
                 │         │  ▲                            │ ▲
                 │         ▼  └──────── (empty) ───────────┘ │
                 └────► COLOCATED ◄──────────────────────────┘
 PREFILL / DECODE / COLOCATED ─► DRAINING ─► IDLE ─► (any serving role, or INACTIVE)
 any ─► DEAD (missed heartbeat or unreachable; terminal — a restarted replica registers anew)
```
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from router.types import ReplicaId, ReplicaInfo, RequestId


class Role(enum.Enum):
    """What a replica's loop does."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    INACTIVE = "inactive"
    LOADING = "loading"
    DRAINING = "draining"
    MUTATING_TO_DECODE = "mutating_to_decode"
    IDLE = "idle"
    DEAD = "dead"


SERVING = frozenset({Role.PREFILL, Role.DECODE, Role.COLOCATED})

_ALLOWED: dict[Role, frozenset[Role]] = {
    Role.INACTIVE: frozenset({Role.LOADING}),
    Role.LOADING: frozenset({*SERVING, Role.INACTIVE}),
    Role.PREFILL: frozenset({Role.MUTATING_TO_DECODE, Role.DECODE, Role.COLOCATED, Role.DRAINING}),
    Role.MUTATING_TO_DECODE: frozenset({Role.DECODE}),
    Role.DECODE: frozenset({Role.PREFILL, Role.COLOCATED, Role.DRAINING}),
    Role.COLOCATED: frozenset({Role.PREFILL, Role.DECODE, Role.DRAINING}),
    Role.DRAINING: frozenset({Role.IDLE}),
    Role.IDLE: frozenset({*SERVING, Role.INACTIVE}),
    Role.DEAD: frozenset(),
}


_REVIVED = {Role.MUTATING_TO_DECODE: Role.DECODE, Role.LOADING: Role.INACTIVE, Role.DRAINING: Role.IDLE}


class TransitionError(ValueError):
    """A role change the state machine does not allow."""


def check_transition(old: Role, new: Role) -> None:
    """Raise `TransitionError` unless `old → new` is allowed (every live role may become DEAD)."""
    if new is Role.DEAD and old is not Role.DEAD:
        return
    if new not in _ALLOWED[old]:
        raise TransitionError(f"replica cannot go from {old.value} to {new.value}")


@dataclass(frozen=True)
class ReplicaView:
    """A replica's state at one instant (cheap to take: no per-request data)."""

    id: ReplicaId
    address: str
    role: Role
    rank: int
    registered: bool
    num_blocks_total: int
    num_blocks_free: int  # as the replica last reported it
    used_blocks: int  # as the router accounts them
    requests: int
    inbound: int
    outbound: int


@dataclass
class ReplicaState:
    """The router's view of one replica: role, facts from Info, and the pages it holds for us."""

    id: ReplicaId
    address: str
    info: ReplicaInfo
    _role: Role
    registered: bool = False
    held: dict[RequestId, int] = field(default_factory=dict)
    promised: int = 0
    inbound: int = 0
    outbound: int = 0
    last_role: Role | None = None  # the role it had when it was declared dead
    page_sync: bool = False  # it refused pages the router counted free: check its count first

    @property
    def role(self) -> Role:
        """The current role (changed only by `set_role` and `revive`)."""
        return self._role

    def set_role(self, new: Role) -> Role:
        """Move to `new` (validated); returns the old role."""
        check_transition(self._role, new)
        old, self._role = self._role, new
        if new is Role.DEAD:
            self.last_role = old
        return old

    def revive(self, others: Iterable[Role]) -> Role:
        """A dead replica answers again: the role it had (settled: a mutation or a load it was in the
        middle of is over), decode if it was prefill and another replica has taken that role, and
        inactive if its weights are not loaded (its `info` is fresh)."""
        if self._role is not Role.DEAD:
            raise TransitionError(f"replica {self.id} is {self._role.value}, not dead")
        last = self.last_role or Role.DECODE
        role = _REVIVED.get(last, last)
        if role is Role.PREFILL and Role.PREFILL in set(others):
            role = Role.DECODE
        if role in SERVING and not self.info.loaded:
            role = Role.INACTIVE
        self._role = role
        return role

    @property
    def used_blocks(self) -> int:
        """Pages held by our batches plus pages promised to migrations on their way here."""
        return sum(self.held.values()) + self.promised

    @property
    def free_blocks(self) -> int:
        """Pages the router may still hand out on this replica."""
        return max(0, self.info.num_blocks_total - self.used_blocks)

    def hold(self, pages: dict[RequestId, int]) -> None:
        """Record pages a batch now holds here."""
        self.held.update(pages)

    def release(self, request_ids: Iterable[RequestId]) -> None:
        """Forget pages the replica freed (filtered, cleared or migrated away)."""
        for rid in request_ids:
            self.held.pop(rid, None)

    @property
    def alive(self) -> bool:
        """Not dead."""
        return self._role is not Role.DEAD

    def snapshot(self) -> ReplicaView:
        """This replica's state now, frozen."""
        info = self.info
        return ReplicaView(self.id, self.address, self._role, info.rank, self.registered,
                           info.num_blocks_total, info.num_blocks_free, self.used_blocks, len(self.held),
                           self.inbound, self.outbound)


class Heartbeats:
    """Heartbeat deadlines on an injected clock: a replica not heard from in `timeout` s is expired."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._last: dict[ReplicaId, float] = {}

    def beat(self, replica: ReplicaId, now: float) -> None:
        """The replica was heard from at `now`."""
        self._last[replica] = now

    def forget(self, replica: ReplicaId) -> None:
        """Stop tracking a replica (dead or removed)."""
        self._last.pop(replica, None)

    def age(self, replica: ReplicaId, now: float) -> float | None:
        """Seconds since the last beat (None when not tracked)."""
        last = self._last.get(replica)
        return None if last is None else now - last

    def expired(self, now: float) -> list[ReplicaId]:
        """Replicas whose deadline passed (they stay tracked until `forget`)."""
        return [r for r, last in self._last.items() if now - last > self.timeout]
