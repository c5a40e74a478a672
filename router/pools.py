"""Several models in one router: one `ClusterScheduler` (queue, replicas, autoscaler) per model, and
the inactive replicas they share.

```
 HTTP (the request's `model`) ──► ModelFront(name) ──► that model's ClusterScheduler
                                      │ no serving replica: wake(name) first (deadline --wake-timeout)
 ModelPools ── spare: inactive replicas no model holds
    every --plan-interval: rebalance (models.rebalance) — models that want no replica give their
    inactive ones back, models short of inactive replicas borrow spares (their autoscaler loads them)
    wake(name): models.wake_action on the model's pool, borrowing a spare first when it has none
                (no spare: another model's idle replica, kept for its keep-alive, is reclaimed);
                it sees every replica's host copies (its own pool's, the other pools', the spares'
                read by Info), and a peer whose host copy is sent is held meanwhile (`peer`)
    an urgent round (an arrival) short of an inactive replica: a spare lent at once, then a round
```
A replica serves one model at a time: it belongs to one model's scheduler (its model known from
Info at start, or from what that scheduler loaded into it) or to the spare pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from router.errors import ReplicaCallError
from router.models import HostCopies, PoolNeed, rebalance, reclaim_order, wake_action
from router.reclaim import held_by, take_back
from router.registry import ReplicaHandle
from router.replica_api import ReplicaApi
from router.replicas import State, TransitionError
from router.scaling.planner import plan
from router.scheduler import ClusterScheduler
from router.types import ErrorEvent, Event, GenerateRequest, ReplicaId, RequestRejected

log = logging.getLogger("pdcluster.router")
WAKE_POLL_S = 0.05  # how often a waking model looks whether its replica serves yet


class ModelPools:
    """The router's models and the spare inactive replicas they share."""

    def __init__(self, schedulers: Mapping[str, ClusterScheduler], spare: Sequence[str],
                 wake_timeout: float, interval: float) -> None:
        self.schedulers = dict(schedulers)
        self.spare = list(spare)  # addresses of inactive replicas that belong to no model
        self.wake_timeout = wake_timeout
        self.interval = interval
        self.wakes = 0  # models brought back from zero (or to their first replica)
        self._waking: dict[str, asyncio.Task[None]] = {}
        self.fronting = Counter[str]()  # requests waiting at each model's front for its wake
        self._lending: dict[str, asyncio.Task[None]] = {}  # spares lent between rounds (urgent)
        self._task: asyncio.Task[None] | None = None
        for name, sched in self.schedulers.items():
            sched.scaling.on_short = functools.partial(self._short, name)
            sched.scaling.executor.peer_source = self.peer
            # a request waiting at the front for the wake is not queued yet: keep a replica for it
            sched.scaling.awaited = functools.partial(self.fronting.__getitem__, name)

    def front(self, name: str) -> ModelFront:
        """The `Scheduler` the front end serves model `name` from."""
        return ModelFront(self, name)

    async def start(self) -> None:
        """Start every model's scheduler and the sharing rounds."""
        for sched in self.schedulers.values():
            await sched.start()
        self.count_spare()
        self._task = asyncio.create_task(self._loop(), name="model-pools")

    async def stop(self) -> None:
        """Stop the rounds and every scheduler."""
        for task in [self._task, *self._waking.values(), *self._lending.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        for sched in self.schedulers.values():
            await sched.stop()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.rebalance()
            except Exception:
                log.exception("model pool round failed")

    def needs(self) -> dict[str, PoolNeed]:
        """Each model's pool as `models.rebalance` sees it (a model whose policy does not plan wants
        nothing beyond what a waiting request wakes)."""
        needs = {}
        for name, sched in self.schedulers.items():
            scaling = sched.scaling
            want = 0
            if scaling.policy.plans:
                decided = plan(scaling.snapshot(), scaling.bounds)
                want = max(decided.prefill.delta, 0) + max(decided.decode.delta, 0)
            needs[name] = PoolNeed(want, self._free_inactive(name), name in self._waking)
        return needs

    def _free_inactive(self, name: str) -> tuple[ReplicaId, ...]:
        """Model `name`'s inactive replicas no action holds."""
        sched = self.schedulers[name]
        return tuple(sorted(h.id for h in sched.replicas.values() if h.state.role is State.INACTIVE
                            and h.id not in sched.scaling.executor.busy))

    def _short(self, name: str, reason: str) -> None:
        """An urgent round of model `name` wanted prefill and had no inactive replica to load: lend it
        a spare now, not at the next sharing round (a burst on one model scales it up at once)."""
        if not self.spare or name in self._lending or self._free_inactive(name):
            return
        task = asyncio.create_task(self._lend_now(name, reason), name=f"lend-{name}")
        self._lending[name] = task
        task.add_done_callback(lambda _t: self._lending.pop(name, None))

    async def _lend_now(self, name: str, reason: str) -> None:
        if await self.lend(name) is not None:
            self.schedulers[name].scaling.round(f"{reason}; a spare lent at once")

    async def rebalance(self) -> None:
        """One sharing round: give back, then lend (`models.rebalance`)."""
        decided = rebalance(self.needs(), len(self.spare))
        for name, rids in decided.release.items():
            for rid in rids:
                address = await release_replica(self.schedulers[name], rid)
                if address is not None:
                    self.spare.append(address)
                    log.info("model %s: replica %s back to the shared pool", name, rid)
        for name, count in decided.lend.items():
            for _ in range(count):
                await self.lend(name)
        self.count_spare()

    def count_spare(self) -> None:
        """`pdcluster_replicas{state="inactive",model=""}`: the shared spare pool."""
        for sched in list(self.schedulers.values())[:1]:  # one registry, shared by every model
            sched.metrics.count_states([State.INACTIVE] * len(self.spare), "")

    async def lend(self, name: str) -> ReplicaId | None:
        """A spare replica joins model `name`'s pool as inactive — one whose host memory holds the
        model when there is one (a LoadParams from host memory there hits: ServerlessLLM's
        locality-aware allocation), else the first — (None: no spare, or it did not answer: it is
        kept out of the pool)."""
        address = await self._spare_for(self.schedulers[name].model_name)
        if address is None:
            return None
        self.spare.remove(address)
        try:
            rid = await self.schedulers[name].add_replica(address, State.INACTIVE)
        except ReplicaCallError as exc:
            log.warning("spare replica %s cannot join model %s: %s", address, name, exc)
            return None
        log.info("model %s: spare replica %s joins as %s", name, address, rid)
        self.count_spare()
        return rid

    async def wake(self, name: str) -> None:
        """Until model `name` has a serving replica (one wake per model at a time, shared by its
        waiting requests); TimeoutError once that wake has run `wake_timeout` seconds."""
        task = self._waking.get(name)
        if task is None:
            task = asyncio.create_task(self._wake_within(name), name=f"wake-{name}")
            self._waking[name] = task
            task.add_done_callback(lambda _t: self._waking.pop(name, None))
        await asyncio.shield(task)  # a waiter that goes away leaves the wake to the others

    async def _wake_within(self, name: str) -> None:
        async with asyncio.timeout(self.wake_timeout):
            await self._wake(name)

    async def _wake(self, name: str) -> None:
        sched = self.schedulers[name]
        started = False
        while not sched.is_healthy():
            if not started:
                own = {h.id: _models(h.state.info.host_copies) for h in sched.replicas.values()}
                action = wake_action(sched.scaling.snapshot().replicas, sched.scaling.policy.caps,
                                     sched.model_name, own, await self.host_copies(name))
                if action is None and not self.spare:
                    await self.reclaim(name)
                if action is None and await self.lend(name) is not None:
                    continue
                if action is not None:
                    log.info("model %s has no serving replica: %s", name, action)
                    sched.scaling.timeline.write("wake", model=name, action=str(action))
                    sched.scaling.start_action(action)
                    started, self.wakes = True, self.wakes + 1
            elif not sched.scaling.tasks:  # the load ended (failed: rolled back) without a server
                started = False
            await asyncio.sleep(WAKE_POLL_S)

    async def reclaim(self, name: str) -> bool:
        """No spare for model `name`'s wake: another model's replica gives its weights up (they stay
        in its host memory) and goes to the spare pool (`models.reclaim_order`, `router/reclaim.py`).
        False: none could be taken."""
        held = [h for other, sched in self.schedulers.items() if other != name
                for h in held_by(other, sched, self.fronting[other])]
        for candidate in reclaim_order(held):
            sched = self.schedulers[candidate.model]
            if not await take_back(sched, candidate):
                continue
            address = await release_replica(sched, candidate.replica)
            if address is not None:
                self.spare.append(address)
                sched.timeline.write("reclaimed", replica=candidate.replica, model=candidate.model,
                                     waking=name)
                log.info("model %s: replica %s of model %s reclaimed for its wake", name, candidate.replica,
                         candidate.model)
                return True
        return False

    def is_healthy(self) -> bool:
        """Some model serves now."""
        return any(s.is_healthy() for s in self.schedulers.values())

    async def host_copies(self, name: str) -> list[HostCopies]:
        """The host copies of every replica outside model `name`'s pool that could send one now:
        the other models' replicas with no action in flight (their last Info), and the spares (an
        Info each, now; one that does not answer is left out)."""
        found = [c for other, sched in self.schedulers.items() if other != name
                 for c in sendable_copies(sched)]
        return found + await self._spare_copies()

    async def _spare_copies(self) -> list[HostCopies]:
        """The spares' host copies, by an Info each now (one that does not answer is left out)."""
        found = []
        for address in list(self.spare):
            client = self._connect(address)
            try:
                info = await client.info()
            except ReplicaCallError:
                continue
            finally:
                await client.close()
            if info.host_copies:
                found.append(HostCopies(address, _models(info.host_copies)))
        return found

    async def _spare_for(self, model: str) -> str | None:
        """The spare to lend for `model` (a checkpoint folder's name): the first whose host memory
        holds it, else the first; None: no spare."""
        if len(self.spare) > 1:
            holding = [c.address for c in await self._spare_copies() if model in c.models]
            chosen = next((a for a in holding if a in self.spare), None)  # a lend meanwhile took none
            if chosen is not None:
                return chosen
        return self.spare[0] if self.spare else None

    def _connect(self, address: str) -> ReplicaApi:
        return next(iter(self.schedulers.values())).connect(address)

    @contextlib.asynccontextmanager
    async def peer(self, address: str) -> AsyncIterator[Peer]:
        """The replica at `address` (another model's, or a spare) as a weight source while the
        context lasts: held busy in its model's pool, or out of the spare pool (no model borrows it
        meanwhile); TransitionError when it is in neither (taken since, or gone), or busy."""
        found = holder_of(self.schedulers.values(), address)
        if found is not None:
            async with held(*found) as peer:
                yield peer
            return
        if address not in self.spare:
            raise TransitionError(f"replica {address} is in no pool any more: its host copy cannot be sent")
        self.spare.remove(address)
        client = self._connect(address)
        try:
            info = await client.info()
            yield Peer(info.rank, info.ranks, client, info.weights_model or info.model_id)
        finally:
            await client.close()
            self.spare.append(address)


def sendable_copies(sched: ClusterScheduler, leave_out: Collection[ReplicaId] = ()) -> list[HostCopies]:
    """The host copies of `sched`'s replicas that could send one now: alive, no action in flight,
    not in `leave_out` (their last Info)."""
    busy = sched.scaling.executor.busy
    return [HostCopies(h.state.address, _models(h.state.info.host_copies)) for h in sched.replicas.values()
            if h.state.alive and h.id not in busy and h.id not in leave_out and h.state.info.host_copies]


def holder_of(scheds: Iterable[ClusterScheduler], address: str
              ) -> tuple[ClusterScheduler, ReplicaHandle] | None:
    """The scheduler holding the replica at `address`, and its handle (None: no pool holds it)."""
    for sched in scheds:
        handle = next((h for h in sched.replicas.values() if h.state.address == address), None)
        if handle is not None:
            return sched, handle
    return None


@contextlib.asynccontextmanager
async def held(sched: ClusterScheduler, handle: ReplicaHandle) -> AsyncIterator[Peer]:
    """`handle` as a weight source while the context lasts, held busy in `sched` (no scaling action,
    lend or reclaim takes it); TransitionError when an action holds it already, or it is dead."""
    busy = sched.scaling.executor.busy
    if handle.id in busy or not handle.state.alive:
        raise TransitionError(f"replica {handle.state.address} is busy or gone: its host copy cannot be "
                              "sent now")
    busy.add(handle.id)
    try:
        yield Peer(handle.rank, handle.ranks, handle.client, handle.layout)
    finally:
        busy.discard(handle.id)


@dataclass(frozen=True)
class Peer:
    """A replica outside the pool a transfer is for, as its source (`router.weights.Member`)."""

    rank: int
    ranks: tuple[int, ...]
    client: ReplicaApi
    layout: str  # the model its weight buffer is laid out for
    alive: bool = True


def _models(copies: Sequence[tuple[str, int]]) -> frozenset[str]:
    return frozenset(name for name, _ in copies)


async def release_replica(sched: ClusterScheduler, rid: ReplicaId) -> str | None:
    """An inactive replica leaves `sched`'s pool: it is forgotten (at once, so no round picks it),
    its loop stopped, its client closed. Returns its address (None: it is not inactive any more, an
    action holds it, or it registered itself: it stays where it heartbeats, its id known)."""
    handle_now = sched.replicas.get(rid)
    if rid in sched.scaling.executor.busy or handle_now is None or handle_now.state.registered:
        return None
    try:
        handle = sched.replicas.remove(rid)
    except (KeyError, ValueError):
        return None
    sched.heartbeats.forget(rid)
    sched.prefix.dead(rid)
    sched.timeline.write("replica_left", replica=rid, address=handle.state.address)
    if handle.task is not None:
        handle.task.cancel()
        with contextlib.suppress(BaseException):
            await handle.task
    await handle.client.close()
    return handle.state.address


class ModelFront:
    """The `Scheduler` of one model: its scheduler's, waking the model first when nothing serves it."""

    def __init__(self, pools: ModelPools, name: str) -> None:
        self.pools = pools
        self.name = name

    def submit(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The model's scheduler's stream; at zero, a stream that waits for a replica first."""
        sched = self.pools.schedulers[self.name]
        if sched.is_healthy():
            return sched.submit(request)
        return self._after_wake(sched, request)

    async def _after_wake(self, sched: ClusterScheduler, request: GenerateRequest) -> AsyncIterator[Event]:
        self.pools.fronting[self.name] += 1
        try:
            await self.pools.wake(self.name)
            stream = sched.submit(request)  # queued at once: its planner sees it from now on
        except TimeoutError:
            yield ErrorEvent(f"model {self.name} has no replica serving it and none could be loaded "
                             f"within {self.pools.wake_timeout:g} s", 503)
            return
        except RequestRejected as exc:
            yield ErrorEvent(str(exc), exc.http_status)
            return
        finally:
            self.pools.fronting[self.name] -= 1
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    def is_healthy(self) -> bool:
        """The model serves now."""
        return self.pools.schedulers[self.name].is_healthy()
