"""The replica registry: every replica the router knows, by id, as the core drives it.

A `ReplicaHandle` is one replica: its `ReplicaState` (role, pages), its client, the inbox of batches
it is to decode, its running batch and its loop's task. `Replicas` holds them and answers the
questions asked across replicas (who serves, who may receive a migration, who becomes prefill);
`snapshot()` is a frozen view of all of them, cheap enough to take every few hundred ms.
The count of replicas in each state is kept as they move (`ReplicaState.move`), so the questions a
loop asks every step (`has_decode`) cost the same whatever the number of replicas.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from router.batches import InboxItem, LiveBatch
from router.episode import Episode
from router.errors import ReplicaCallError
from router.replica_api import ReplicaApi
from router.replicas import SERVING, Observer, ReplicaState, ReplicaView, ServingLimits, State, Trigger
from router.states import PREFILL_LIKE
from router.types import ReplicaId, ReplicaInfo

log = logging.getLogger("pdcluster.router")

_CANNOT_SERVE = frozenset({State.DEAD, State.INACTIVE})  # no loop runs a request without an admin call
_DECODING = (State.DECODE, State.MUTATING_TO_DECODE)
_PREFILLING = PREFILL_LIKE | {State.COLOCATED}  # a replica in one of these makes `settle_roles` a no-op


@dataclass
class ReplicaHandle:
    """A replica as the core drives it: state, client, inbox of batches to decode, worker task."""

    state: ReplicaState
    client: ReplicaApi
    inbox: list[InboxItem] = field(default_factory=list)
    running: LiveBatch | None = None
    task: asyncio.Task[None] | None = None
    zigzag: Episode | None = None  # its layer-by-layer prefills while it loads (live scaling)

    @property
    def id(self) -> ReplicaId:
        """The router's id of this replica."""
        return self.state.id

    @property
    def rank(self) -> int:
        """Its global rank (rank 0 of its tensor-parallel group)."""
        return self.state.info.rank

    @property
    def ranks(self) -> tuple[int, ...]:
        """Its group's global ranks, one per tp_rank (Migrate src/dst, broadcasts, pipe_peer)."""
        return self.state.info.ranks

    @property
    def alive(self) -> bool:
        """Not declared dead."""
        return self.state.alive

    @property
    def layout(self) -> str:
        """The model its weight buffer is laid out for (what it holds or last held, else the checkpoint
        it started with)."""
        return self.state.info.weights_model or self.state.info.model_id

    @property
    def block_size(self) -> int:
        """Tokens per KV page."""
        return self.state.info.block_size

    @property
    def empty(self) -> bool:
        """Holds nothing for us and expects nothing."""
        s = self.state
        return self.running is None and not self.inbox and not s.held and not s.inbound and not s.outbound

    def forget_work(self) -> None:
        """Drop the batches the router had for it (it died, or it came back and was cleared)."""
        self.inbox.clear()
        self.running = None

    async def prune(self, live: LiveBatch) -> LiveBatch | None:
        """Filter a cached batch here down to the requests still wanted (None: cleared).

        On a failed call the batch's pages are forgotten and the replica's error is raised (the
        caller re-runs or fails the requests still wanted).
        """
        keep = live.wanted_ids()
        if len(keep) == len(live.members):
            return live
        gone = [rid for rid in live.members if rid not in keep]
        try:
            if not keep:
                await self.client.clear_cache(live.id)
                self.state.release(gone)
                return None
            cached = await self.client.filter_batch(live.id, keep)
        except ReplicaCallError:
            self.state.release(live.members)
            raise
        self.state.release(gone)
        return LiveBatch(cached, {rid: live.members[rid] for rid in keep}, live.block_size)


def fabric_conflict(address: str, info: ReplicaInfo, others: Iterable[ReplicaState]) -> str | None:
    """Why the replica at `address` cannot join `others` (the live replicas): its fabric differs from
    theirs, so no KV or weights could move between them (a cuda-ipc replica's tickets would reach a
    tcp replica as data). None when it may join; an unknown fabric ("") is never held against it."""
    if not info.fabric:
        return None
    for other in others:
        if other.alive and other.info.fabric and other.info.fabric != info.fabric:
            return (f"replica {address} moves KV and weights over fabric {info.fabric}, but replica "
                    f"{other.address} uses {other.info.fabric}: start every replica of a cluster with the "
                    f"same --fabric (auto picks per replica: on a mixed CPU/GPU cluster name one)")
    return None


class Replicas(Mapping[ReplicaId, ReplicaHandle]):
    """Every replica the router knows (dead ones included), by id."""

    def __init__(self, ids: Iterator[int] | None = None) -> None:
        self._handles: dict[ReplicaId, ReplicaHandle] = {}
        # several models' registries share one counter: a replica id names one replica router-wide
        self._ids = ids if ids is not None else itertools.count(0)
        self._roles: Counter[State] = Counter()  # replicas in each state, kept by `_moved`
        self.on_move: Observer | None = None  # told of every state change after the counts
        self.on_info: Callable[[ReplicaState], None] | None = None  # told of every Info a replica gave
        self._limits: ServingLimits | None = None  # of the serving replicas; None: to be computed
        self._decode: dict[ReplicaId, ReplicaState] = {}  # the replicas in State.DECODE, kept by `_moved`

    def __getitem__(self, rid: ReplicaId) -> ReplicaHandle:
        handle = self._handles.get(rid)
        if handle is None:
            raise KeyError(f"no replica with id {rid}")
        return handle

    def __iter__(self) -> Iterator[ReplicaId]:
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)

    def add(self, address: str, info: ReplicaInfo, role: State, client: ReplicaApi,
            registered: bool = False) -> ReplicaHandle:
        """Register a replica under the next id."""
        state = ReplicaState(ReplicaId(next(self._ids)), address, info, role, registered)
        state.observer = self._moved
        state.on_info = self._info_changed
        self._limits = None
        if role is State.DECODE:
            self._decode[state.id] = state
        handle = ReplicaHandle(state, client)
        self._handles[handle.id] = handle
        self._roles[role] += 1
        return handle

    def remove(self, rid: ReplicaId) -> ReplicaHandle:
        """Forget an inactive replica (it leaves for another model's pool); ValueError for any other."""
        handle = self[rid]
        if handle.state.role is not State.INACTIVE:
            raise ValueError(f"replica {rid} is {handle.state.role.value}: only an inactive one can leave")
        del self._handles[rid]
        self._roles[State.INACTIVE] -= 1
        return handle

    def _moved(self, state: ReplicaState, old: State, new: State, trigger: Trigger) -> None:
        self._roles[old] -= 1
        self._roles[new] += 1
        if (old in SERVING) != (new in SERVING):
            self._limits = None
        if new is State.DECODE:
            self._decode[state.id] = state
        elif old is State.DECODE:
            self._decode.pop(state.id, None)
        if self.on_move is not None:
            self.on_move(state, old, new, trigger)

    def count(self, roles: frozenset[State] | tuple[State, ...]) -> int:
        """How many replicas are in one of `roles` now."""
        return sum(self._roles[role] for role in roles)

    def _info_changed(self, state: ReplicaState) -> None:
        if state.role in SERVING:
            self._limits = None
        if self.on_info is not None:
            self.on_info(state)

    def serving(self) -> list[ReplicaInfo]:
        """Info of every replica in a serving role."""
        return [h.state.info for h in self._handles.values() if h.state.role in SERVING]

    def limits(self) -> ServingLimits:
        """The serving replicas' tightest limits (kept until a replica starts or stops serving, or a
        serving one's Info changes: a request's check costs the same whatever the replica count)."""
        if self._limits is None:
            self._limits = ServingLimits.of(self.serving())
        return self._limits

    def can_serve(self) -> bool:
        """Some replica could still run a request (without an admin call bringing one back)."""
        return len(self._handles) > self.count(_CANNOT_SERVE)

    def has_decode(self) -> bool:
        """A live decode replica exists (else prefill replicas decode their own batches)."""
        return self.count(_DECODING) > 0

    def receivers(self, src: ReplicaHandle) -> list[ReplicaState]:
        """The replicas in State.DECODE but `src` (candidates for a migration from it). The index is
        kept as replicas move, so a hand-off looks at these only, not at every replica."""
        found = [s for rid, s in self._decode.items() if rid != src.id]
        # KV moves shard i to tp_rank i: only a group of the same size can take it (with none, the
        # replica refuses the move naming both sizes)
        same = [s for s in found if s.info.tp_size == src.state.info.tp_size]
        return same or found

    def settle_roles(self) -> ReplicaHandle | None:
        """Keep a prefill replica in a disaggregated cluster: an empty decode replica takes the role,
        unless one is on its way (loading its weights, or joining as prefill): the autoscaler's plan
        stands, as it counts those as prefill replicas too.

        Returns the replica that became prefill, if one did.
        """
        if self.count(_PREFILLING) or not self.count((State.DECODE,)):
            return None
        for handle in self._handles.values():
            if handle.state.role is State.DECODE and handle.empty:
                handle.state.move(State.PREFILL, Trigger.TAKE_PREFILL)
                log.info("replica %s becomes a prefill replica", handle.id)
                return handle
        return None

    def snapshot(self) -> tuple[ReplicaView, ...]:
        """Every replica's state now, frozen, by id."""
        return tuple(h.state.snapshot() for h in self._handles.values())
