"""The router's view of one replica: its state, page accounting, heartbeat expiry (pure Python).

Every state change goes through `ReplicaState.move`, checked against the one transition table of
`router/states.py` (a dead replica comes back only through `revive`); each change is reported to
the observer the scheduler installs (timeline, metrics). `snapshot()` is a frozen copy of the state
for readers that must not change it (the admin service, the planner).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from router.states import SERVING, State, TransitionError, Trigger, check
from router.types import ReplicaId, ReplicaInfo, RequestId

__all__ = ["SERVING", "Heartbeats", "ReplicaState", "ReplicaView", "ServingLimits", "State",
           "TransitionError", "Trigger"]

Observer = Callable[["ReplicaState", State, State, Trigger], None]
"""Called after every state change: (replica, old state, new state, trigger)."""


@dataclass(frozen=True)
class ServingLimits:
    """What every serving replica can take: the tightest limits among them (0 = no replica says)."""

    replicas: int  # how many serve
    max_input_tokens: int = 0
    max_total_tokens: int = 0
    min_kv_tokens: int = 0  # the fewest tokens of KV a serving replica holds

    @classmethod
    def of(cls, infos: Iterable[ReplicaInfo]) -> ServingLimits:
        """The limits of these replicas' Info."""
        infos = list(infos)
        return cls(len(infos),
                   min((i.max_input_tokens for i in infos if i.max_input_tokens), default=0),
                   min((i.max_total_tokens for i in infos if i.max_total_tokens), default=0),
                   min((i.num_blocks_total * i.block_size for i in infos), default=0))


# Where a replica that was declared dead in the middle of a change comes back (the change is over).
_REVIVED = {State.MUTATING_TO_DECODE: State.DECODE, State.LOADING_PREFILL: State.INACTIVE,
            State.LOADING_DECODE: State.INACTIVE, State.NEW_PREFILL: State.INACTIVE,
            State.REFRACTORY_PREFILL: State.PREFILL, State.OLD_PREFILL: State.PREFILL,
            State.DRAINING_PREFILL: State.IDLE, State.DRAINING_DECODE: State.IDLE}
_SERVING_ROLES = (State.PREFILL, State.DECODE, State.COLOCATED)


@dataclass(frozen=True)
class ReplicaView:
    """A replica's state at one instant (cheap to take: no per-request data)."""

    id: ReplicaId
    address: str
    role: State
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
    _info: ReplicaInfo
    _role: State
    registered: bool = False
    held: dict[RequestId, int] = field(default_factory=dict)  # change it through hold / release
    promised: int = 0
    inbound: int = 0
    outbound: int = 0
    last_role: State | None = None  # the state it had when it was declared dead
    lost_role: State | None = None  # the serving role a revival without weights lost (to load it back)
    page_sync: bool = False  # it refused pages the router counted free: check its count first
    since: float = 0.0  # when it entered its state (set by the observer; the keep-alive counts from it)
    observer: Observer | None = None
    on_info: Callable[[ReplicaState], None] | None = None  # called after `info` is replaced
    # the process the router took in at this address (Info `instance`; "": an old replica)
    process: str = field(default="", init=False)
    _held_pages: int = field(default=0, init=False)  # sum(held.values()), kept as `held` changes

    def __post_init__(self) -> None:
        self._held_pages = sum(self.held.values())
        self.process = self._info.instance

    @property
    def info(self) -> ReplicaInfo:
        """What the replica last said of itself (Info)."""
        return self._info

    @info.setter
    def info(self, value: ReplicaInfo) -> None:
        self._info = value
        if self.on_info is not None:
            self.on_info(self)

    @property
    def role(self) -> State:
        """The current state (changed only by `move` and `revive`)."""
        return self._role

    def move(self, new: State, trigger: Trigger) -> State:
        """Move to `new` on `trigger` (validated by the transition table); returns the old state."""
        check(self._role, new, trigger)
        old, self._role = self._role, new
        if new is State.DEAD:
            self.last_role = old
        if self.observer is not None:
            self.observer(self, old, new, trigger)
        return old

    def revive(self, others: Iterable[State]) -> State:
        """A dead replica answers again: the state it had (settled: a mutation or a load it was in the
        middle of is over), decode if it was prefill and another replica has taken that role, and
        inactive if its weights are not loaded (its `info` is fresh; `lost_role` then keeps the serving
        role it had, which the router gives it back by loading its weights again)."""
        if self._role is not State.DEAD:
            raise TransitionError(f"replica {self.id} is {self._role.value}, not dead")
        last = self.last_role or State.DECODE
        role = _REVIVED.get(last, last)
        if role is State.PREFILL and State.PREFILL in set(others):
            role = State.DECODE
        self.lost_role = None
        if role in _SERVING_ROLES and not self.info.loaded:  # restarted: `lost_role` says what it was
            role, self.lost_role = State.INACTIVE, role
        if role is State.IDLE and not self.info.loaded:
            role = State.INACTIVE
        self.move(role, Trigger.ANSWERED)
        return role

    @property
    def used_blocks(self) -> int:
        """Pages held by our batches plus pages promised to migrations on their way here."""
        return self._held_pages + self.promised

    @property
    def free_blocks(self) -> int:
        """Pages the router may still hand out on this replica."""
        return max(0, self._info.num_blocks_total - self._held_pages - self.promised)

    def hold(self, pages: dict[RequestId, int]) -> None:
        """Record pages a batch now holds here."""
        held = self.held
        for rid, n in pages.items():
            self._held_pages += n - held.get(rid, 0)
            held[rid] = n

    def release(self, request_ids: Iterable[RequestId]) -> None:
        """Forget pages the replica freed (filtered, cleared or migrated away)."""
        for rid in request_ids:
            self._held_pages -= self.held.pop(rid, 0)

    def release_all(self) -> None:
        """Forget every page held here (the replica died)."""
        self.held.clear()
        self._held_pages = 0

    @property
    def alive(self) -> bool:
        """Not dead."""
        return self._role is not State.DEAD

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

    def stalled(self, seconds: float, now: float) -> None:
        """The router itself stalled for `seconds` (its own timers ran that late: a long GC pause, a
        starved host): that time does not count against any replica (no beat moves past `now`)."""
        for replica, last in self._last.items():
            self._last[replica] = min(now, last + seconds)

    def expired(self, now: float) -> list[ReplicaId]:
        """Replicas whose deadline passed (they stay tracked until `forget`)."""
        return [r for r, last in self._last.items() if now - last > self.timeout]
