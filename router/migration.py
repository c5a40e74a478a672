"""The migration queue: how a prefilled batch reaches a decode replica, per strategy.

| strategy      | after the prefill on P                                                         |
|---------------|--------------------------------------------------------------------------------|
| `full`        | pick D by free pages; `Migrate` on P ‖ `Immigrate` on D; D merges it           |
| `progressive` | D picked *before* the prefill: `PrefillV2(MIGRATE_PROGRESSIVE, pipe_peer=D)` ‖ |
|               | `Immigrate` on D; P's copy is cleared                                          |
| `mutate`      | P becomes a decode replica and decodes its own batch; an empty D takes P's role|
| `recompute`   | P's copy is cleared; D prefills prompt + first token again                     |
| `colocated`   | no migration (the loops never hand batches here)                               |

Destinations are the DECODE replicas with the most free pages, at most `max_inbound_migrations`
migrations into each at once. A replica answering UNIMPLEMENTED for a migration RPC makes that
batch fall back to `recompute` (recorded in the route), so requests never fail for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from router.batches import Arrived, LiveBatch, Member, Reprefill, member_blocks, migrated_blocks, spec_for
from router.client import (
    PeerFailed,
    PrefillCase,
    ReplicaCallError,
    ReplicaUnavailable,
    ReplicaUnimplemented,
)
from router.config import Strategy
from router.loops import prune
from router.queue import BatchId
from router.replicas import ReplicaState, Role

if TYPE_CHECKING:
    from router.loops import ReplicaWorker
    from router.scheduler import ClusterScheduler, ReplicaHandle

log = logging.getLogger("pdcluster.router")

_LOCAL_ROLES = (Role.DECODE, Role.MUTATING_TO_DECODE, Role.COLOCATED)


def choose_destination(candidates: Sequence[ReplicaState], need_blocks: int, max_inbound: int
                       ) -> ReplicaState | None:
    """The decode replica with the most free pages that fits `need_blocks` and has an inbound slot."""
    eligible = [
        r for r in candidates
        if r.role is Role.DECODE and r.inbound < max_inbound and r.free_blocks >= need_blocks
    ]
    if not eligible:
        return None
    return max(eligible, key=lambda r: (r.free_blocks, -r.inbound, -r.id))


class Abandoned(Exception):
    """The batch's source died or its requests went away while it waited for a destination."""


class Migrations:
    """Runs hand-offs as tasks; one task per prefilled batch."""

    def __init__(self, hub: ClusterScheduler) -> None:
        self.hub = hub
        self.tasks: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()

    def hand_off(self, src: ReplicaHandle, live: LiveBatch, strategy: Strategy) -> None:
        """Move a batch prefilled on `src` to decode, by `strategy`."""
        if strategy is Strategy.MUTATE:
            self.mutate(src, live)
            return
        src.state.outbound += 1
        run = self.recompute if strategy is Strategy.RECOMPUTE else self.full
        task = asyncio.create_task(self._guarded(src, run(src, live)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guarded(self, src: ReplicaHandle, job: object) -> None:
        try:
            await job  # type: ignore[misc]
        except Abandoned:
            pass
        except Exception:
            log.exception("migration from replica %s failed", src.id)
        finally:
            src.state.outbound -= 1
            self.hub.notify()

    async def reserve(self, src: ReplicaHandle, need: int, live: LiveBatch | None) -> ReplicaHandle | None:
        """Wait for a destination and reserve `need` pages on it; None = decode on `src` itself."""
        while True:
            if not src.state.alive or (live is not None and not live.wanted_ids()):
                raise Abandoned
            if src.state.role in _LOCAL_ROLES:
                return None
            token = self.hub.change_token()
            others = [h.state for h in self.hub.replicas.values() if h is not src]
            chosen = choose_destination(others, need, self.hub.config.max_inbound_migrations)
            if chosen is not None:
                chosen.inbound += 1
                chosen.promised += need
                return self.hub.replicas[chosen.id]
            if not self.hub.has_decode() and self.hub.strategy is not Strategy.MUTATE:
                return None
            await self.hub.wait_change(token)

    def _unreserve(self, dst: ReplicaHandle, need: int) -> None:
        dst.state.inbound -= 1
        dst.state.promised -= need
        self.hub.notify()

    # ---- strategies ----------------------------------------------------------------------------------

    def mutate(self, src: ReplicaHandle, live: LiveBatch) -> None:
        """No transfer: the prefill replica becomes a decode replica and keeps its batch."""
        if src.state.role is Role.PREFILL:
            src.state.set_role(Role.MUTATING_TO_DECODE)
            src.state.set_role(Role.DECODE)
            log.info("replica %s mutated to decode", src.id)
        self._local(src, live)
        self.hub.ensure_roles()

    def _local(self, src: ReplicaHandle, live: LiveBatch) -> None:
        """Decode the batch where it is: `src` became a decode replica, or there is no other."""
        local = Strategy.MUTATE if src.state.role is not Role.PREFILL else Strategy.COLOCATED
        for m in live.members.values():
            m.state.route.decode_replica = src.id
            m.state.route.strategy = local.value
        src.inbox.append(Arrived(live, {}))
        self.hub.notify()

    async def full(self, src: ReplicaHandle, live: LiveBatch) -> None:
        """Migrate ‖ Immigrate to the chosen decode replica."""
        need = sum(live.pages().values())
        try:
            dst = await self.reserve(src, need, live)
        except Abandoned:
            if src.state.alive:  # every client went away while it waited: free it on P
                await prune(self.hub, src, live)
            return
        if dst is None:
            self._local(src, live)
            return
        try:
            await self._transfer(src, dst, live)
        finally:
            self._unreserve(dst, need)

    async def _transfer(self, src: ReplicaHandle, dst: ReplicaHandle, live: LiveBatch) -> None:
        pruned = await prune(self.hub, src, live)
        if pruned is None:
            return
        spec, t0 = pruned.spec(), self.hub.clock()
        migrate = asyncio.ensure_future(src.client.migrate(spec, [src.rank], [dst.rank]))
        immigrate = asyncio.ensure_future(dst.client.immigrate(spec, [src.rank], [dst.rank]))
        # A sender that is gone will send no header: stop the receiver's wait (it frees its pages on
        # the cancel) instead of letting it run to its deadline with the batch's requests waiting.
        migrate.add_done_callback(lambda done: _cancel_if_gone(done, immigrate))
        # and a receiver that is unreachable is dead now, not once the sender's connect gives up on it
        immigrate.add_done_callback(lambda done: self._mark_dead_if_gone(dst, done))
        sent, got = await asyncio.gather(migrate, immigrate, return_exceptions=True)
        if isinstance(sent, BaseException) or isinstance(got, BaseException):
            errors = [e for e in (sent, got) if isinstance(e, Exception)]  # not the cancelled wait
            await self._failed(src, dst, pruned, errors)
            return
        src.state.release(pruned.members)
        self._arrive(dst, LiveBatch.of(got, list(pruned.members.values()), pruned.block_size),
                     Strategy.FULL, self.hub.clock() - t0)

    def _arrive(self, dst: ReplicaHandle, live: LiveBatch, strategy: Strategy, seconds: float) -> None:
        """A batch's KV is on `dst`: account its pages, record the routes, hand it to the loop.

        Each route gets its own request's KV bytes and the batch's transfer time.
        """
        pages = live.pages()
        dst.state.hold(pages)
        lasts = {}
        for rid, m in live.members.items():
            m.state.replica = dst.id
            m.state.route.decode_replica = dst.id
            m.state.route.strategy = strategy.value
            m.state.route.migration_bytes += (migrated_blocks(m, live.block_size) * live.block_size
                                              * self.hub.kv_bytes_per_token)
            m.state.route.migration_seconds += seconds
            if m.state.generated:
                lasts[rid] = m.state.generated[-1]
        self.hub.metrics.migration(strategy.value, self.hub.kv_bytes(live), seconds)
        dst.inbox.append(Arrived(live, lasts))
        self.hub.notify()

    async def _failed(self, src: ReplicaHandle, dst: ReplicaHandle, live: LiveBatch,
                      errors: Sequence[BaseException]) -> None:
        """A migration failed: fall back, re-run or fail the batch's requests by what failed."""
        with contextlib.suppress(ReplicaCallError):
            await dst.client.clear_cache(live.id)
        if any(isinstance(e, ReplicaUnimplemented) for e in errors):
            self._warn_once("full", errors)
            await self.recompute(src, live)
            return
        members = list(live.members.values())
        for exc in errors:
            if isinstance(exc, ReplicaUnavailable):
                self.hub.mark_dead(_side(exc, src, dst).id, str(exc))
        with contextlib.suppress(ReplicaCallError):
            await src.client.clear_cache(live.id)
        src.state.release(live.members)
        if any(isinstance(e, ReplicaUnavailable | PeerFailed) for e in errors):  # the requests are fine
            self.hub.requeue(members, f"migration failed: {errors[0]}")
        else:
            self.hub.fail(members, f"migration of batch {live.id} failed: {errors[0]}", 502)

    def _warn_once(self, what: str, errors: Sequence[BaseException]) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s migration is not implemented by the replicas (%s): falling back to "
                        "recompute", what, errors[0])

    async def recompute(self, src: ReplicaHandle, live: LiveBatch) -> None:
        """Free the batch on P; the decode replica prefills prompt + generated tokens again."""
        members = [m for m in live.members.values() if m.wanted]
        with contextlib.suppress(ReplicaCallError):
            await src.client.clear_cache(live.id)
        src.state.release(live.members)
        if not members:
            return
        fresh = []
        for m in members:
            m.state.new_run()
            fresh.append(Member.now(m.state))
            m.state.route.strategy = Strategy.RECOMPUTE.value
            m.state.route.migration_bytes += 4 * len(m.state.current().input_ids)
        need = sum(member_blocks(m, live.block_size) for m in fresh)
        try:
            dst = await self.reserve(src, need, None)
        except Abandoned:
            self.hub.requeue(fresh, "prefill replica died")
            return
        target = dst or src
        for m in fresh:
            m.state.replica = target.id
        target.inbox.append(Reprefill(tuple(fresh), need if dst else 0, self.hub.clock()))
        self.hub.notify()

    async def progressive(self, worker: ReplicaWorker, batch_id: BatchId, members: list[Member]) -> None:
        """Prefill on P while its KV streams layer by layer to D (which `Immigrate`s it)."""
        src, bs = worker.h, worker.h.block_size
        need = sum(member_blocks(m, bs) for m in members)
        try:
            dst = await self.reserve(src, need, None)
        except Abandoned:
            self.hub.requeue(members, "prefill replica died")
            return
        if dst is None:
            live = await worker.run_prefill(members, batch_id)
            if live is not None:
                self._local(src, live)
            return
        try:
            await self._progressive(worker, dst, batch_id, members)
        finally:
            self._unreserve(dst, need)

    async def _progressive(self, worker: ReplicaWorker, dst: ReplicaHandle, batch_id: BatchId,
                           members: list[Member]) -> None:
        src = worker.h
        spec, t0 = spec_for(batch_id, members, src.block_size), self.hub.clock()
        receive = asyncio.create_task(dst.client.immigrate(spec, [src.rank], [dst.rank]))
        # a receiver that is unreachable is dead now, not when the sender's connect gives up on it
        receive.add_done_callback(lambda done: self._mark_dead_if_gone(dst, done))
        try:
            live = await worker.run_prefill(members, batch_id, PrefillCase.MIGRATE_PROGRESSIVE, (dst.rank,),
                                            raise_errors=True)
        except ReplicaCallError as exc:
            receive.cancel()
            with contextlib.suppress(BaseException):
                await receive
            with contextlib.suppress(ReplicaCallError):
                await dst.client.clear_cache(batch_id)
            if not isinstance(exc, ReplicaUnimplemented):
                self.hub.on_error(src, exc, members)
                return
            self._warn_once("progressive", [exc])
            live = await worker.run_prefill(members, batch_id)
            if live is not None:
                self.hand_off(src, live, Strategy.FULL)
            return
        try:
            got = await receive
        except ReplicaCallError as exc:
            await self._receiver_failed(src, dst, batch_id, live, exc)
            return
        # nothing to clear on P: a MIGRATE_PROGRESSIVE prefill never caches its batch there
        src.state.release([m.id for m in members])
        arrived = LiveBatch.of(got, members, src.block_size)
        self._arrive(dst, arrived, Strategy.PROGRESSIVE, self.hub.clock() - t0)

    def _mark_dead_if_gone(self, handle: ReplicaHandle, call: asyncio.Future[Any]) -> None:
        """`handle`'s own call failed as unreachable (not because of its peer): it is dead."""
        if _gone(call):
            self.hub.mark_dead(handle.id, str(call.exception()))

    async def _receiver_failed(self, src: ReplicaHandle, dst: ReplicaHandle, batch_id: BatchId,
                               live: LiveBatch | None, exc: ReplicaCallError) -> None:
        """The prefill ran but the receiver failed: the batch is still on P, send it by recompute."""
        with contextlib.suppress(ReplicaCallError):
            await dst.client.clear_cache(batch_id)
        # an unreachable receiver was marked dead when its call failed (`_mark_dead_if_gone`)
        if isinstance(exc, ReplicaUnimplemented):
            self._warn_once("progressive", [exc])
        if live is None:
            return
        if isinstance(exc, ReplicaUnavailable | ReplicaUnimplemented | PeerFailed):
            self.hand_off(src, live, Strategy.RECOMPUTE)
            return
        with contextlib.suppress(ReplicaCallError):
            await src.client.clear_cache(live.id)
        src.state.release(live.members)
        self.hub.fail(list(live.members.values()), f"migration of batch {batch_id} failed: {exc}", 502)


def _gone(call: asyncio.Future[Any]) -> bool:
    """The call failed because its replica could not be reached (UNAVAILABLE without a peer cause)."""
    if call.cancelled():
        return False
    return isinstance(call.exception(), ReplicaUnavailable)  # PeerFailed is not one: the caller is alive


def _cancel_if_gone(sender: asyncio.Future[Any], receiver: asyncio.Future[Any]) -> None:
    if _gone(sender) and not receiver.done():
        receiver.cancel()


def _side(exc: ReplicaUnavailable, src: ReplicaHandle, dst: ReplicaHandle) -> ReplicaHandle:
    """Which side of a migration an UNAVAILABLE error came from (the receiver when unclear)."""
    return src if exc.address == src.state.address else dst
