"""One loop per replica; what it does each step follows the replica's role.

| role (effective)        | step                                                                  |
|-------------------------|-----------------------------------------------------------------------|
| PREFILL                 | take a batch off the queue, prefill, hand it to the migration queue   |
| DECODE, MUTATING        | prefill re-sent requests, merge arrived batches into the running one  |
|                         | (DecodeV2 with their last tokens), one step, filter finished requests |
| COLOCATED               | one prefill from the queue joined into the running batch, one step    |
| DRAINING                | decode what it has, wait for its outbound migrations, then IDLE       |
| INACTIVE, LOADING, IDLE | nothing                                                               |

A prefill replica with no decode replica in the cluster (or under the `colocated` strategy) runs
colocated. A replica error fails only the requests of the batch it hit; an unreachable replica is
declared dead and its requests re-run elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.batches import Arrived, LiveBatch, Member, Reprefill, member_blocks, spec_for
from router.client import PrefillCase, ReplicaCallError, ReplicaUnavailable, StepResult
from router.config import Strategy
from router.queue import BatchId
from router.replicas import Role
from router.types import RequestId

if TYPE_CHECKING:
    from router.scheduler import ClusterScheduler, ReplicaHandle

log = logging.getLogger("pdcluster.router")


class Mode(enum.Enum):
    """What a loop step does."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    DRAIN = "drain"
    IDLE = "idle"


def effective_mode(role: Role, strategy: Strategy, has_decode: bool) -> Mode:
    """The loop mode for a role under the current strategy."""
    if role is Role.COLOCATED:
        return Mode.COLOCATED
    if role is Role.PREFILL:
        colocate = strategy is Strategy.COLOCATED or (not has_decode and strategy is not Strategy.MUTATE)
        return Mode.COLOCATED if colocate else Mode.PREFILL
    if role in (Role.DECODE, Role.MUTATING_TO_DECODE):
        return Mode.COLOCATED if strategy is Strategy.COLOCATED else Mode.DECODE
    if role is Role.DRAINING:
        return Mode.DRAIN
    return Mode.IDLE


class ReplicaWorker:
    """The loop of one replica."""

    def __init__(self, hub: ClusterScheduler, handle: ReplicaHandle) -> None:
        self.hub = hub
        self.h = handle
        self._in_flight: _InFlight | None = None  # a decode step sent ahead (pipelining)

    async def run(self) -> None:
        """Step until the replica dies; unexpected errors are logged, never fatal to the router."""
        try:
            await self._steps()
        finally:
            self.cancel_in_flight()

    async def _steps(self) -> None:
        while self.h.state.alive and not self.hub.stopping:
            token = self.hub.change_token()
            try:
                did = await self.step()
            except ReplicaCallError as exc:
                log.warning("replica %s: %s", self.h.id, exc)
                did = False
            except Exception:
                log.exception("replica %s loop step failed", self.h.id)
                did = False
            if did:
                await asyncio.sleep(0)
            else:
                await self.hub.wait_change(token)

    async def step(self) -> bool:
        """One iteration; True when it did work."""
        if self._in_flight is not None:  # a step sent ahead is collected first, whatever the mode
            return await self.decode_once()
        mode = effective_mode(self.h.state.role, self.hub.strategy, self.hub.has_decode())
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

    # ---- prefill -----------------------------------------------------------------------------------

    async def prefill_for_migration(self) -> bool:
        """PREFILL mode: one batch from the queue, then to the migration queue."""
        if self.h.state.outbound >= self.hub.config.max_pending_migrations:
            return False
        taken = self.hub.next_batch(self.h)
        if taken is None:
            return False
        planned, members = taken
        strategy = self.hub.strategy
        for m in members:
            m.state.route.strategy = strategy.value
        if strategy is Strategy.PROGRESSIVE:
            await self.hub.migrations.progressive(self, planned.id, members)
            return True
        live = await self.run_prefill(members, planned.id)
        if live is not None:
            self.hub.migrations.hand_off(self.h, live, strategy)
        return True

    async def prefill_local(self) -> bool:
        """COLOCATED mode: one batch from the queue, prefilled here and joined to the running batch."""
        taken = self.hub.next_batch(self.h)
        if taken is None:
            return False
        planned, members = taken
        for m in members:
            m.state.route.strategy = Strategy.COLOCATED.value
            m.state.route.decode_replica = self.h.id
        live = await self.run_prefill(members, planned.id)
        if live is not None:
            self.h.inbox.append(Arrived(live, {}))
        return True

    async def run_prefill(self, members: list[Member], batch_id: BatchId,
                          case: PrefillCase = PrefillCase.NORMAL, pipe_peer: tuple[int, ...] = (),
                          raise_errors: bool = False, from_queue: bool = True) -> LiveBatch | None:
        """Prefill `members` here; stream their first tokens; return the cached batch, pruned.

        A failed call releases its pages and, unless `raise_errors`, fails (or re-runs) the members.
        `from_queue` is False for a decode replica's re-prefill (the route keeps the prefill replica).
        """
        spec = spec_for(batch_id, members, self.h.block_size)
        pages = {m.id: spec_pages for m, spec_pages in zip(members, self._pages(members), strict=True)}
        self.h.state.hold(pages)
        for m in members:
            m.state.replica = self.h.id
            if from_queue:
                m.state.route.prefill_replica = self.h.id
        try:
            result = await self.h.client.prefill(spec, case, pipe_peer)
        except ReplicaCallError as exc:
            self.h.state.release(pages)
            if raise_errors:
                raise
            self.hub.on_error(self.h, exc, members)
            return None
        self.hub.deliver(result, {m.id: m for m in members})
        if result.batch is None:
            self.h.state.release(pages)
            return None
        return await self.prune(LiveBatch.of(result.batch, members, self.h.block_size))

    def _pages(self, members: list[Member]) -> list[int]:
        return [member_blocks(m, self.h.block_size) for m in members]

    # ---- decode ------------------------------------------------------------------------------------

    async def decode_once(self) -> bool:
        """Merge what arrived into the running batch and run one decode step.

        Pipelined: when the step's batch goes on unchanged (nothing arrived, every request still
        wanted), the next DecodeV2 is sent before this step's tokens are streamed, so the replica
        computes while the router works. The replica keeps the sampled tokens and skips finished
        requests; anything that needs a FilterBatch or a merge waits for a sequential step.
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            batches, lasts = await self._gather_batches()
            if not batches:
                self._maybe_become_prefill()
                return False
            members = {rid: m for b in batches for rid, m in b.members.items()}
            last_tokens = [_last_tokens(b, last) for b, last in zip(batches, lasts, strict=True)]
            flight = _InFlight(batches, members, self.h.client.start_decode([b.cached for b in batches],
                                                                           last_tokens))
        try:
            result = await flight.result
        except ReplicaCallError as exc:
            if not isinstance(exc, ReplicaUnavailable):  # a dead replica holds nothing to free
                await self._drop_batches(flight.batches)
            self.hub.on_error(self.h, exc, flight.members.values())
            return True
        await self._after_step(result, flight.members)
        self.hub.notify()
        return True

    async def _after_step(self, result: StepResult, members: dict[RequestId, Member]) -> None:
        """Start the next step when it can go now, stream this step's tokens, then prune."""
        if result.batch is None:
            self.hub.deliver(result, members)
            self.h.state.release(members)
            self.h.running = None
            return
        live = LiveBatch.of(result.batch, list(members.values()), self.h.block_size)
        self.h.running = live
        if not self.h.inbox and len(live.wanted_ids()) == len(live.members):
            call = self.h.client.start_decode([live.cached], [[]])
            self._in_flight = _InFlight([live], live.members, call)
            await asyncio.sleep(0)  # the call's send runs before the streams woken by deliver
        self.hub.deliver(result, members)
        if self._in_flight is None:
            self.h.running = await self.prune(live)

    def cancel_in_flight(self) -> None:
        """Drop a pipelined step nobody will wait for (the loop ends)."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            flight.result.close()

    async def _gather_batches(self) -> tuple[list[LiveBatch], list[dict[RequestId, int]]]:
        batches: list[LiveBatch] = []
        lasts: list[dict[RequestId, int]] = []
        if self.h.running is not None:
            self.h.running = await self.prune(self.h.running)
            if self.h.running is not None:
                batches.append(self.h.running)
                lasts.append({})
        inbox, self.h.inbox = self.h.inbox, []
        for item in inbox:
            arrived = await self._accept(item)
            if arrived is None:
                continue
            live = await self.prune(arrived.batch)
            if live is not None:
                for m in live.members.values():
                    m.state.route.decode_replica = self.h.id
                batches.append(live)
                lasts.append(dict(arrived.last_tokens))
        return batches, lasts

    async def _accept(self, item: Arrived | Reprefill) -> Arrived | None:
        if isinstance(item, Arrived):
            return item
        self.h.state.promised -= item.promised
        self.h.state.inbound -= 1 if item.promised else 0
        members = [m for m in item.members if m.wanted]
        if not members:
            return None
        live = await self.run_prefill(members, self.hub.queue.batch_ids.next(), from_queue=False)
        elapsed = self.hub.clock() - item.sent_at
        for m in members:
            m.state.route.migration_seconds += elapsed
        sent = sum(4 * len(m.request.input_ids) for m in members)  # token ids, 4 bytes each
        self.hub.metrics.migration(Strategy.RECOMPUTE.value, sent, elapsed)
        return Arrived(live, {}) if live is not None else None

    async def _drop_batches(self, batches: list[LiveBatch]) -> None:
        """After a failed step, free what the replica may still hold for these batches."""
        for b in batches:
            with contextlib.suppress(ReplicaCallError):
                await self.h.client.clear_cache(b.id)
            self.h.state.release(b.members)
        self.h.running = None

    async def prune(self, live: LiveBatch) -> LiveBatch | None:
        """Drop finished, cancelled and stale requests from a cached batch (the replica frees them)."""
        return await prune(self.hub, self.h, live)

    def _maybe_become_prefill(self) -> None:
        if self.h.state.role is Role.DECODE and self.h.empty:
            self.hub.ensure_roles()

    # ---- drain -------------------------------------------------------------------------------------

    async def drain_once(self) -> bool:
        """Decode what is left; once nothing is held or in flight, the replica is IDLE."""
        did = await self.decode_once()
        if not did and self.h.empty:
            self.h.state.set_role(Role.IDLE)
            log.info("replica %s drained", self.h.id)
            self.hub.notify()
        return did


@dataclass
class _InFlight:
    """A decode step on the wire: its batches, their members, and the call's result."""

    batches: list[LiveBatch]
    members: dict[RequestId, Member]
    result: Coroutine[Any, Any, StepResult]


def _last_tokens(batch: LiveBatch, last: dict[RequestId, int]) -> list[int]:
    """The `last_iter_tokens` ids of one batch, in its request order (empty: nothing to append)."""
    ids = [last[rid] for rid in batch.cached.request_ids if rid in last]
    return ids if len(ids) == len(batch.cached.request_ids) else []


async def prune(hub: ClusterScheduler, handle: ReplicaHandle, live: LiveBatch) -> LiveBatch | None:
    """Filter a cached batch on its replica down to the requests still wanted (None: cleared)."""
    keep = live.wanted_ids()
    if len(keep) == len(live.members):
        return live
    gone = [rid for rid in live.members if rid not in keep]
    try:
        if not keep:
            await handle.client.clear_cache(live.id)
            handle.state.release(gone)
            return None
        cached = await handle.client.filter_batch(live.id, keep)
    except ReplicaCallError as exc:
        handle.state.release(live.members)
        hub.on_error(handle, exc, [live.members[rid] for rid in keep])
        return None
    handle.state.release(gone)
    hub.notify()
    return LiveBatch(cached, {rid: live.members[rid] for rid in keep}, live.block_size)
