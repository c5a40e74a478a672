"""One loop per replica; what it does each step follows the replica's role and the strategy.

| mode (`MigrationStrategy.mode`) | step                                                          |
|---------------------------------|---------------------------------------------------------------|
| PREFILL                 | take a batch off the queue, `strategy.prefill`, hand it to the migration |
|                         | queue (up to `PREFILL_DEPTH` prefills on the wire if `pipelined`)        |
| DECODE                  | merge arrived batches into the running one, one step (`decoding.py`)     |
| COLOCATED               | one prefill from the queue joined into the running batch, one step; a    |
|                         | longer batch a chunk per step (`chunked.py`)                              |
| DRAIN                   | decode what it has, wait for its outbound migrations, then IDLE          |
| IDLE                    | nothing                                                                  |

New, refractory and old prefill replicas (live scaling) step by `zigzag.py` instead.

A loop drives its own replica only; it asks the cluster through `cluster.Cluster`. A replica error
fails only the requests of the batch it hit; an unreachable replica is declared dead and its
requests re-run elsewhere; a replica out of pages gets the batch again once it freed them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from router import strategies, zigzag
from router.batches import Arrived, LiveBatch, Member, member_blocks, spec_for
from router.chunked import ChunkedPrefill, needs_chunks
from router.cluster import Cluster, LoopLimits
from router.decoding import PIPELINE_DEPTH, DecodeLoop
from router.errors import ReplicaCallError
from router.migration import Migrations
from router.registry import ReplicaHandle
from router.replicas import State, Trigger
from router.strategies.base import MigrationStrategy, Mode
from router.types import BatchId, PrefillCase, RequestId, StepResult
from router.wakeup import Wakeups

__all__ = ["PIPELINE_DEPTH", "PREFILL_DEPTH", "ReplicaWorker"]

log = logging.getLogger("pdcluster.router")

# PrefillV2 calls a PREFILL-mode loop keeps on the wire: while one batch is prefilled the next one
# (cut from what queued meanwhile) is already waiting on the replica, so the engine does not idle
# for the round trip and the router's hand-off between two prefills.
PREFILL_DEPTH = 2
ZIGZAG_STATES = frozenset({State.NEW_PREFILL, State.REFRACTORY_PREFILL, State.OLD_PREFILL})

# After a page refusal: how long a loop waits for its replica to free what the router released
# (a free queued on the replica's engine thread behind a call that overtook it), polling its Info.
PAGE_SYNC_S = 1.0
PAGE_SYNC_POLL_S = 0.005


class ReplicaWorker:
    """The loop of one replica."""

    def __init__(self, cluster: Cluster, handle: ReplicaHandle, wakeups: Wakeups, limits: LoopLimits) -> None:
        self.cluster = cluster
        self.h = handle
        self.wakeups = wakeups
        self.limits = limits
        self.decode = DecodeLoop(cluster, handle, wakeups, self._reprefill, limits.max_batch_prefill_tokens,
                                 self._prefill_waiting)
        self._prefills: set[asyncio.Task[None]] = set()  # PREFILL mode: prefills on the wire
        self.chunked = ChunkedPrefill(handle, limits.prefill_chunk_tokens, self.prefill_answered,
                                      lambda exc, members: cluster.on_error(handle, exc, members),
                                      lambda: wakeups.pages(handle.id), limits.prefill_chunk_share,
                                      cluster.clock)
        self._took = False  # this step took a batch off the queue

    async def run(self) -> None:
        """Step until the replica dies; unexpected errors are logged, never fatal to the router."""
        try:
            await self._steps()
        finally:
            self.decode.cancel_in_flight()
            if self.cluster.stopping:
                for task in self._prefills:
                    task.cancel()

    async def _steps(self) -> None:
        wakeup = self.wakeups.loop(self.h.id)  # woken by the changes that give this loop work
        while self.h.state.alive and not self.cluster.stopping:
            token = wakeup.token()
            self.wakeups.stepping(self.h.id)
            self._took = False
            try:
                did = await self.step()
            except ReplicaCallError as exc:
                log.warning("replica %s: %s", self.h.id, exc)
                did = False
            except Exception:
                log.exception("replica %s loop step failed", self.h.id)
                did = False
            self.wakeups.stepped(self.h.id, self._took, self.cluster.queued()[0])
            if did:
                await asyncio.sleep(0)
            else:
                await wakeup.wait(token)

    async def step(self) -> bool:
        """One iteration; True when it did work."""
        if self.decode.in_flight:  # steps sent ahead are collected first, whatever the mode
            return await self.decode.step()
        if self.chunked.busy:  # a batch prefilled in chunks goes on whatever the mode now is
            chunked = await self._join(self.chunked.step())
            began = self.cluster.clock()
            stepped = await self.decode_once()
            self.chunked.decoded(self.cluster.clock() - began)
            return chunked or stepped
        role = self.h.state.role
        if role in ZIGZAG_STATES:
            return await self._zigzag(role)
        mode = self.cluster.strategy.mode(role, self.cluster.has_decode())
        if mode is Mode.PREFILL:
            # A batch left here by an earlier mode (colocated, or no decode replica then) still decodes here.
            prefilled = await self.prefill_for_migration()
            stepped = await self.decode_once() if self.h.running or self.h.inbox else False
            return prefilled or stepped
        if mode is Mode.DECODE:
            return await self.decode_once()
        if mode is Mode.COLOCATED:
            joined = await self.prefill_local()
            stepped = await self.decode_once()
            return joined or stepped
        if mode is Mode.DRAIN:
            return await self.drain_once()
        return False

    def _prefill_waiting(self) -> bool:
        """Prefill work this loop must fit between decode steps: a chunk to run, or (colocated) a
        queued prompt. Decode steps are not sent ahead meanwhile, or it would wait for the batch."""
        if self.chunked.busy:
            return True
        mode = self.cluster.strategy.mode(self.h.state.role, self.cluster.has_decode())
        return mode is Mode.COLOCATED and self.cluster.queued()[0] > 0

    async def _zigzag(self, role: State) -> bool:
        """Live scaling (zigzag.py): a new replica prefills layer by layer, an old one takes over."""
        handoff = zigzag.hand_off_strategy(self.cluster.strategy, strategies.get(strategies.Strategy.FULL))
        moves = self.cluster.moves
        if role is State.OLD_PREFILL:
            # relay a new replica's batch if there is one; else prefill from the queue as usual
            did = await zigzag.relay_step(self, moves, handoff)
            if not did and self.h.state.role is State.OLD_PREFILL:
                did = await self.prefill_for_migration()
        else:
            did = await zigzag.zig_step(self, moves, handoff)
        # a batch left here by an earlier role still decodes here
        stepped = await self.decode_once() if self.h.running or self.h.inbox else False
        return did or stepped

    # ---- prefill -----------------------------------------------------------------------------------

    async def prefill_for_migration(self) -> bool:
        """PREFILL mode: one batch from the queue, prefilled, then to the migration queue.

        Up to `PREFILL_DEPTH` prefills are on the wire at once (each in its own task) for a
        pipelined strategy, so this returns as soon as the batch is sent; a finished prefill wakes
        the loop for the next one. Prefills in flight count against `max_pending_migrations` like
        the batches they become.
        """
        pending = self.h.state.outbound + len(self._prefills)
        if len(self._prefills) >= PREFILL_DEPTH or pending >= self.limits.max_pending_migrations:
            return False
        taken = await self.take_batch()
        if taken is None:
            return False
        strategy = self.cluster.strategy
        for m in taken[1]:
            m.state.batched(strategy.name)
        job = _Job(self, strategy, *taken)
        if not strategy.pipelined:  # it drives the batch's calls itself, one batch at a time
            await job.run()
            return True
        task = asyncio.create_task(job.run())
        self._prefills.add(task)
        task.add_done_callback(self._prefill_done)
        return True

    def _prefill_done(self, task: asyncio.Task[None]) -> None:
        self._prefills.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("replica %s prefill failed", self.h.id, exc_info=exc)
        self.wakeups.replica(self.h.id)  # a slot on the wire is free

    async def prefill_local(self) -> bool:
        """COLOCATED mode: one batch from the queue, prefilled here and joined to the running batch
        (one longer than `max_batch_prefill_tokens` a chunk per step: `chunked.py`)."""
        taken = await self.take_batch()
        if taken is None:
            return False
        batch_id, members = taken
        for m in members:
            m.state.decoding(self.h.id, "colocated")
        if needs_chunks(members, self.chunked.chunk_tokens):
            return await self._join(self.chunked.start(batch_id, members))
        return await self._join(self.run_prefill(members, batch_id))

    async def _join(self, prefill: Awaitable[LiveBatch | None]) -> bool:
        """Await a prefill; its cached batch joins the running batch with the next decode step."""
        live = await prefill
        if live is not None:
            self.h.inbox.append(Arrived(live, {}))
        return True

    async def take_batch(self) -> tuple[BatchId, list[Member]] | None:
        """The next batch from the queue that fits this replica (after a page refusal, once the
        replica's own count caught up)."""
        if self.h.state.page_sync:
            await self._sync_pages()
        taken = self.cluster.take_batch(self.h)
        if taken is None:
            self.wakeups.wants_batch(self.h.id)
        else:
            self._took = True
        return taken

    async def _sync_pages(self) -> None:
        """The replica refused a batch for pages the router counted free: wait (a bounded while)
        until its own count shows them free, so the next batch is cut from what it really has."""
        state = self.h.state
        state.page_sync = False
        loop = asyncio.get_running_loop()
        end = loop.time() + PAGE_SYNC_S
        while True:
            try:
                state.info = await self.h.client.info()
            except ReplicaCallError:
                return
            if state.info.num_blocks_free >= state.free_blocks or loop.time() > end:
                return
            await asyncio.sleep(PAGE_SYNC_POLL_S)

    async def run_prefill(self, members: list[Member], batch_id: BatchId,
                          case: PrefillCase = PrefillCase.NORMAL, peer: ReplicaHandle | None = None,
                          raise_errors: bool = False, from_queue: bool = True,
                          resume: int | None = None) -> LiveBatch | None:
        """Prefill `members` here; stream their first tokens; return the cached batch, pruned (a
        migrating case's batch as the replica reported it: it is cached on its receiver, not here).

        A failed call releases its pages and, unless `raise_errors`, fails (or re-runs) the members.
        `from_queue` is False for a decode replica's re-prefill (the route keeps the prefill replica).
        """
        spec = spec_for(batch_id, members, self.h.block_size)
        pages = {m.id: member_blocks(m, self.h.block_size) for m in members}
        self.h.state.hold(pages)
        for m in members:
            m.state.prefilling(self.h.id, from_queue)
        pipe_peer = peer.ranks if peer is not None else ()
        start = self.cluster.clock()
        try:
            result = await self.h.client.prefill(spec, case, pipe_peer, resume)
        except asyncio.CancelledError:  # its migration's receiver is gone, or the router stops
            self.h.state.release(pages)
            self.wakeups.pages(self.h.id)
            raise
        except ReplicaCallError as exc:
            self.h.state.release(pages)
            self.wakeups.pages(self.h.id)
            if raise_errors:
                raise
            self.cluster.on_error(self.h, exc, members)
            return None
        return await self.prefill_answered(members, pages, result, self.cluster.clock() - start, case)

    async def prefill_answered(self, members: list[Member], pages: dict[RequestId, int], result: StepResult,
                               seconds: float, case: PrefillCase = PrefillCase.NORMAL) -> LiveBatch | None:
        """A prefill's first tokens: measured, indexed, streamed; the cached batch, pruned (`pages`:
        what the router holds for it on this replica, released when every request finished)."""
        self.cluster.prefilled(sum(len(m.request.input_ids) for m in members), seconds)
        self.cluster.prefill_done(self.h, members, result)
        self.cluster.deliver(result, {m.id: m for m in members})
        if result.batch is None:
            self.h.state.release(pages)
            self.wakeups.pages(self.h.id)
            return None
        live = LiveBatch.of(result.batch, members, self.h.block_size)
        if case is not PrefillCase.NORMAL:
            # The batch left with its KV (MIGRATE*: not cached here, FilterBatch would be NOT_FOUND);
            # requests that finished or went away meanwhile are pruned where it arrives.
            return live
        return await self.decode.prune(live)

    async def _reprefill(self, members: list[Member], batch_id: BatchId) -> LiveBatch | None:
        return await self.run_prefill(members, batch_id, from_queue=False)

    # ---- decode ------------------------------------------------------------------------------------

    async def decode_once(self) -> bool:
        """One decode step (see `decoding.py`); an empty decode replica may take the prefill role."""
        did = await self.decode.step()
        if not did and self.h.state.role is State.DECODE and self.h.empty:
            self.cluster.settle_roles()
        return did

    async def drain_once(self) -> bool:
        """Decode what is left; once nothing is held or in flight, the replica is IDLE."""
        did = await self.decode.step()
        if not did and self.h.empty:
            self.h.state.move(State.IDLE, Trigger.DRAINED)
            log.info("replica %s drained", self.h.id)
            self.wakeups.all()
        return did


class _Job:
    """One batch cut for this replica's prefill, as the strategy sees it (`strategies.base.PrefillJob`)."""

    def __init__(self, worker: ReplicaWorker, strategy: MigrationStrategy, batch_id: BatchId,
                 members: list[Member]) -> None:
        self._worker = worker
        self._strategy = strategy
        self.batch_id = batch_id
        self.members = members

    @property
    def replica(self) -> ReplicaHandle:
        """The prefill replica."""
        return self._worker.h

    @property
    def moves(self) -> Migrations:
        """The migration queue."""
        return self._worker.cluster.moves

    async def prefill(self, case: PrefillCase = PrefillCase.NORMAL, peer: ReplicaHandle | None = None,
                      raise_errors: bool = False) -> LiveBatch | None:
        """PrefillV2 of this batch on the replica."""
        return await self._worker.run_prefill(self.members, self.batch_id, case, peer, raise_errors)

    async def run(self) -> None:
        """The strategy's prefill, then its hand-off as a task of the migration queue."""
        live = await self._strategy.prefill(self)
        if live is not None:
            self.moves.spawn(self.replica, self._strategy.hand_off(self.moves, self.replica, live))
