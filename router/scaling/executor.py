"""Carrying out scaling actions on the cluster, one action per replica at a time, with rollback.

```
 Revive      DRAINING_* ─revive─► PREFILL / DECODE                         (nothing moves)
 Reactivate  IDLE ─reactivate─► PREFILL / DECODE                           (weights kept)
 Mutate      PREFILL ─mutate─► MUTATING_TO_DECODE ─mutated─► DECODE       (its batches decode there)
 Drain       PREFILL / DECODE ─drain─► DRAINING_* (its loop: ─drained─► IDLE once empty)
 Expire      IDLE ─expire─► INACTIVE after ResetStatus
 Load        INACTIVE ─load_prefill / load_decode / live_load─► LOADING_* / NEW_PREFILL
               (live: as many loaded PREFILL replicas ─relay_start─► OLD_PREFILL)
               weights.move(method) ─► Info says loaded ─loaded─► PREFILL / DECODE / REFRACTORY_PREFILL
               failure: every target still loading ─load_failed─► INACTIVE (its zigzag prefills
               cancelled and re-run), an unreachable one is dead; sources keep serving
```
Every action marks its replicas busy until it ends (the planner's next rounds leave them alone), is
written to the timeline, and counted in `pdcluster_scaling_actions_total{action,outcome}`. A failed
action leaves the cluster consistent (targets inactive, sources serving, no pages or parameter
operations held) and a later round tries again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from router import weights, zigzag
from router.errors import ReplicaCallError, ReplicaUnavailable
from router.migration import Migrations
from router.registry import ReplicaHandle, Replicas
from router.replicas import State, TransitionError, Trigger
from router.scaling.actions import Action, Drain, Expire, Kind, Load, Mutate, Reactivate, Revive
from router.scaling.timeline import Timeline
from router.types import ReplicaId

log = logging.getLogger("pdcluster.router")

# a replica outside this pool, by address, as a transfer's source for as long as the context lasts
PeerSource = Callable[[str], AbstractAsyncContextManager[weights.Member]]
ACTION_NAMES = ("revive", "reactivate", "mutate", "load", "drain", "expire")
_SERVES = {Kind.PREFILL: State.PREFILL, Kind.DECODE: State.DECODE}
_DRAINING = {Kind.PREFILL: State.DRAINING_PREFILL, Kind.DECODE: State.DRAINING_DECODE}


class ScalingHost(Protocol):
    """What the executor asks of the cluster."""

    replicas: Replicas
    clock: Callable[[], float]

    @property
    def moves(self) -> Migrations:
        """The migration queue (zigzag prefills of a failed live load re-run through it)."""
        ...

    @property
    def weight_bytes(self) -> int:
        """Bytes of one replica's weights (what a load moves per target)."""
        ...

    @property
    def model_name(self) -> str:
        """The checkpoint's folder name under the replicas' model root (what LoadParams loads)."""
        ...

    def mark_dead(self, rid: ReplicaId, reason: str) -> None:
        """The replica is gone."""
        ...

    def queued(self) -> tuple[int, int]:
        """Requests and prompt tokens waiting for a prefill."""
        ...

    def settle_roles(self) -> None:
        """Keep a prefill replica in a disaggregated cluster."""
        ...

    def notify(self) -> None:
        """Wake the loops."""
        ...


def action_name(action: Action) -> str:
    """The action's kind, as metrics and the timeline name it."""
    return type(action).__name__.lower()


def replicas_of(action: Action) -> tuple[ReplicaId, ...]:
    """Every replica an action uses (marked busy while it runs)."""
    if isinstance(action, Load):
        return (*action.sources, *action.targets)
    return (action.replica,)


class Executor:
    """Runs actions against the cluster; `busy` names the replicas with an action in flight."""

    def __init__(self, host: ScalingHost, timeline: Timeline, on_done: Callable[[str, bool], None]) -> None:
        self.host = host
        self.timeline = timeline
        self.on_done = on_done
        self.busy: set[ReplicaId] = set()
        self.peer_source: PeerSource | None = None  # set by the model pools (HOST_PEER loads)

    async def run(self, action: Action) -> bool:
        """Carry out one action; True when it succeeded (a failure is logged, rolled back, counted)."""
        members = replicas_of(action)
        self.busy.update(members)
        ok = False
        try:
            await self._run(action)
            ok = True
        except (ReplicaCallError, TransitionError, ValueError) as exc:
            log.warning("scaling action %s failed: %s", action, exc)
        finally:
            self.busy.difference_update(members)
            self.on_done(action_name(action), ok)
            self.host.notify()
        return ok

    async def _run(self, action: Action) -> None:
        if isinstance(action, Load):
            await self._load(action)
            return
        handle = self.host.replicas[action.replica]
        if isinstance(action, Revive):
            handle.state.move(_SERVES[action.kind], Trigger.REVIVE)
        elif isinstance(action, Reactivate):
            handle.state.move(_SERVES[action.kind], Trigger.REACTIVATE)
        elif isinstance(action, Mutate):
            handle.state.move(State.MUTATING_TO_DECODE, Trigger.MUTATE)
            handle.state.move(State.DECODE, Trigger.MUTATED)
            self.host.settle_roles()
        elif isinstance(action, Drain):
            kind = Kind.PREFILL if handle.state.role is State.PREFILL else Kind.DECODE
            handle.state.move(_DRAINING[kind], Trigger.DRAIN)
            self.host.settle_roles()
        elif isinstance(action, Expire):
            await self._expire(handle)

    async def _expire(self, handle: ReplicaHandle) -> None:
        if handle.state.role is not State.IDLE:
            raise TransitionError(f"replica {handle.id} is {handle.state.role.value}, not idle")
        try:
            await handle.client.reset_status()
        except ReplicaCallError as exc:
            self.host.mark_dead(handle.id, f"ResetStatus failed: {exc}")
            raise
        handle.state.move(State.INACTIVE, Trigger.EXPIRE)
        handle.state.info = await handle.client.info()

    async def _load(self, action: Load) -> None:
        sources = [self.host.replicas[i] for i in action.sources]
        targets = [self.host.replicas[i] for i in action.targets]
        loading, trigger = _loading(action)
        for t in targets:
            t.state.move(loading, trigger)
        if action.live:
            self._relayers(len(targets))
        self.host.notify()  # a new prefill replica's loop starts its layer-by-layer prefills now
        t0 = self.host.clock()
        nbytes = self.host.weight_bytes * len(targets)
        error = ""
        try:
            await self._move(action, sources, targets)
            await self._ready(targets, loading, action.kind)
        except BaseException as exc:
            error = repr(exc)
            self._bury([*sources, *targets], exc)
            await self._roll_back(targets, loading)
            raise
        finally:
            self.timeline.write("transfer", method=action.method, sources=action.sources,
                                targets=action.targets, role=action.kind, live=action.live, bytes=nbytes,
                                seconds=round(self.host.clock() - t0, 6), ok=not error, error=error,
                                **({"peers": action.peers} if action.peers else {}))

    async def _move(self, action: Load, sources: list[ReplicaHandle], targets: list[ReplicaHandle]) -> None:
        """The weights into the targets; peers outside the pool (HOST_PEER) are borrowed meanwhile."""
        if not action.peers:
            await weights.move(action.method, sources, targets, self.host.model_name)
            return
        if self.peer_source is None:
            raise ValueError(f"{action.method.value} from {action.peers}: no pools to borrow a peer from")
        async with contextlib.AsyncExitStack() as stack:
            peers = [await stack.enter_async_context(self.peer_source(p)) for p in action.peers]
            await weights.move(action.method, peers, targets, self.host.model_name)

    def _relayers(self, n: int) -> None:
        """As many loaded prefill replicas as new ones (the least loaded first) take relayed batches
        over while the new ones load; each goes back to PREFILL once no new replica is left."""
        prefills = sorted((h for h in self.host.replicas.values() if h.state.role is State.PREFILL
                           and h.id not in self.busy), key=lambda h: (h.state.used_blocks, h.id))
        for handle in prefills[:n]:
            handle.state.move(State.OLD_PREFILL, Trigger.RELAY_START)

    def _bury(self, members: list[ReplicaHandle], exc: BaseException) -> None:
        """A member that could not be reached (not one whose peer failed) is dead."""
        if isinstance(exc, ReplicaUnavailable):
            for member in members:
                if member.state.address == exc.address:
                    self.host.mark_dead(member.id, f"unreachable during a weight transfer: {exc}")

    async def _ready(self, targets: list[ReplicaHandle], loading: State, kind: Kind) -> None:
        """Targets whose weights are complete take their job (a new prefill replica goes on with
        its zigzag prefills as refractory); one unreachable now is dead; raise if any is not ready."""
        role = State.REFRACTORY_PREFILL if loading is State.NEW_PREFILL else _SERVES[kind]
        await weights.become_ready(self.host, targets, role)

    async def _roll_back(self, targets: Iterable[ReplicaHandle], loading: State) -> None:
        """A failed load: every target still loading becomes inactive again, its zigzag prefills
        cancelled (their requests re-run on other replicas)."""
        for t in targets:
            if loading is State.NEW_PREFILL:
                await zigzag.abandon(t, self.host.moves)
            if t.state.role is loading:
                t.state.move(State.INACTIVE, Trigger.LOAD_FAILED)


def _loading(action: Load) -> tuple[State, Trigger]:
    """The state targets take while their weights arrive."""
    if action.live:
        return State.NEW_PREFILL, Trigger.LIVE_LOAD
    if action.kind is Kind.DECODE:
        return State.LOADING_DECODE, Trigger.LOAD_DECODE
    return State.LOADING_PREFILL, Trigger.LOAD_PREFILL
