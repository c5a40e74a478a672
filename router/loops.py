"""One loop per replica; what it does each step follows the replica's role.

| role (effective)        | step                                                                  |
|-------------------------|-----------------------------------------------------------------------|
| PREFILL                 | take a batch off the queue, prefill, hand it to the migration queue   |
|                         | (up to `PREFILL_DEPTH` prefills on the wire)                          |
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
import collections
import contextlib
import enum
import logging
import secrets
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

# DecodeV2 calls a decode loop keeps on the wire while its batch goes on unchanged: the replica
# has the next step queued when one ends, so neither the round trip (~1 ms of gRPC client to
# client on the 2-core dev box) nor the router's streaming of the previous step sits between two
# steps. With 2, a 0.4–1 ms step was still bound by the round trip; 3 gave +17–20% decode tokens/s
# over gRPC at batch 1 and 8 (`pdcluster bench replica`), 4 no more.
PIPELINE_DEPTH = 3

# PrefillV2 calls a PREFILL-mode loop keeps on the wire: while one batch is prefilled the next one
# (cut from what queued meanwhile) is already waiting on the replica, so the engine does not idle
# for the round trip and the router's hand-off between two prefills.
PREFILL_DEPTH = 2


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
        self._flights: collections.deque[_InFlight] = collections.deque()  # decode steps on the wire
        self._call_prefix = secrets.token_hex(6)  # names this loop's pipelined calls (unique per run)
        self._calls = 0
        self._prefills: set[asyncio.Task[None]] = set()  # PREFILL mode: prefills on the wire

    async def run(self) -> None:
        """Step until the replica dies; unexpected errors are logged, never fatal to the router."""
        try:
            await self._steps()
        finally:
            self.cancel_in_flight()
            if self.hub.stopping:
                for task in self._prefills:
                    task.cancel()

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
        if self._flights:  # steps sent ahead are collected first, whatever the mode
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
        """PREFILL mode: one batch from the queue, prefilled, then to the migration queue.

        Up to `PREFILL_DEPTH` prefills are on the wire at once (each in its own task), so this
        returns as soon as the batch is sent; a finished prefill wakes the loop for the next one.
        Prefills in flight count against `max_pending_migrations` like the batches they become.
        """
        pending = self.h.state.outbound + len(self._prefills)
        if len(self._prefills) >= PREFILL_DEPTH or pending >= self.hub.config.max_pending_migrations:
            return False
        taken = self.hub.next_batch(self.h)
        if taken is None:
            return False
        planned, members = taken
        strategy = self.hub.strategy
        for m in members:
            m.state.route.strategy = strategy.value
        if strategy is Strategy.PROGRESSIVE:  # drives both replicas' calls itself, one batch at a time
            await self.hub.migrations.progressive(self, planned.id, members)
            return True
        task = asyncio.create_task(self._prefill_and_hand_off(members, planned.id, strategy))
        self._prefills.add(task)
        task.add_done_callback(self._prefill_done)
        return True

    async def _prefill_and_hand_off(
        self, members: list[Member], batch_id: BatchId, strategy: Strategy
    ) -> None:
        live = await self.run_prefill(members, batch_id)
        if live is not None:
            self.hub.migrations.hand_off(self.h, live, strategy)

    def _prefill_done(self, task: asyncio.Task[None]) -> None:
        self._prefills.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("replica %s prefill failed", self.h.id, exc_info=exc)
        self.hub.notify()  # a slot on the wire is free

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
        """Prefill `members` here; stream their first tokens; return the cached batch, pruned (a
        migrating case's batch as the replica reported it: it is cached on its receiver, not here).

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
        live = LiveBatch.of(result.batch, members, self.h.block_size)
        if case is not PrefillCase.NORMAL:
            # The batch left with its KV (MIGRATE*: not cached here, FilterBatch would be NOT_FOUND);
            # requests that finished or went away meanwhile are pruned where it arrives.
            return live
        return await self.prune(live)

    def _pages(self, members: list[Member]) -> list[int]:
        return [member_blocks(m, self.h.block_size) for m in members]

    # ---- decode ------------------------------------------------------------------------------------

    async def decode_once(self) -> bool:
        """Merge what arrived into the running batch and run one decode step.

        Pipelined: while the batch goes on unchanged (nothing arrived, every request still wanted),
        up to `PIPELINE_DEPTH` DecodeV2 calls are on the wire, the next ones sent before this
        step's tokens are streamed, so the replica's engine never waits for the round trip or for
        the router's work. The replica keeps the sampled tokens and skips finished requests; a step
        that needs a FilterBatch or a merge waits until the steps sent ahead are collected.
        """
        if not self._flights:
            batches, lasts = await self._gather_batches()
            if not batches:
                self._maybe_become_prefill()
                return False
            members = {rid: m for b in batches for rid, m in b.members.items()}
            last_tokens = [_last_tokens(b, last) for b, last in zip(batches, lasts, strict=True)]
            call = self.h.client.start_decode([b.cached for b in batches], last_tokens)
            self._flights.append(_InFlight(batches, members, call))
        flight = self._flights.popleft()
        try:
            result = await flight.result
        except ReplicaCallError as exc:
            await self._settle_flights()
            if not isinstance(exc, ReplicaUnavailable):  # a dead replica holds nothing to free
                await self._drop_batches(flight.batches)
            self.hub.on_error(self.h, exc, flight.members.values())
            return True
        await self._after_step(result, flight.members)
        self.hub.notify()
        return True

    async def _after_step(self, result: StepResult, members: dict[RequestId, Member]) -> None:
        """Send the next steps when they can go now, stream this step's tokens, then prune."""
        if result.batch is None:
            await self._settle_flights()  # steps sent ahead find the batch gone: nothing was run
            self.hub.deliver(result, members)
            self.h.state.release(members)
            self.h.running = None
            return
        live = LiveBatch.of(result.batch, list(members.values()), self.h.block_size)
        self.h.running = live
        if not self.h.inbox and len(live.wanted_ids()) == len(live.members):
            while len(self._flights) < PIPELINE_DEPTH:
                self._send_ahead(live)
            await asyncio.sleep(0)  # the calls' sends run before the streams woken by deliver
            self.hub.deliver(result, members)
            return
        self.hub.deliver(result, members)
        if not self._flights:  # else the steps sent ahead are collected first, then this runs again
            self.h.running = await self.prune(live)

    def _send_ahead(self, live: LiveBatch) -> None:
        """Put one more step of `live` on the wire, queued on the replica after the one before it."""
        self._calls += 1
        call_id = f"{self._call_prefix}-{self._calls}"
        after = self._flights[-1].call_id if self._flights else ""
        call = self.h.client.start_decode([live.cached], [[]], call_id, after)
        self._flights.append(_InFlight([live], live.members, call, call_id))

    async def _settle_flights(self) -> None:
        """Wait for the steps sent ahead and drop their outcome (the batch ended or failed)."""
        while self._flights:
            flight = self._flights.popleft()
            with contextlib.suppress(ReplicaCallError):
                await flight.result

    def cancel_in_flight(self) -> None:
        """Drop the steps sent ahead that nobody will wait for (the loop ends)."""
        while self._flights:
            self._flights.popleft().result.close()

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
            for arrived in await self._accept(item):
                live = await self.prune(arrived.batch)
                if live is not None:
                    for m in live.members.values():
                        m.state.route.decode_replica = self.h.id
                    batches.append(live)
                    lasts.append(dict(arrived.last_tokens))
        return batches, lasts

    async def _accept(self, item: Arrived | Reprefill) -> list[Arrived]:
        if isinstance(item, Arrived):
            return [item]
        self.h.state.promised -= item.promised
        self.h.state.inbound -= 1 if item.promised else 0
        members = [m for m in item.members if m.wanted]
        if not members:
            return []
        arrived = []
        # prompt + the tokens generated so far can exceed the prefill budget the batch was cut to
        for group in _prefill_groups(members, self.hub.config.max_batch_prefill_tokens):
            live = await self.run_prefill(group, self.hub.queue.batch_ids.next(), from_queue=False)
            if live is not None:
                arrived.append(Arrived(live, {}))
        elapsed = self.hub.clock() - item.sent_at
        for m in members:
            m.state.route.migration_seconds += elapsed
        sent = sum(4 * len(m.request.input_ids) for m in members)  # token ids, 4 bytes each
        self.hub.metrics.migration(Strategy.RECOMPUTE.value, sent, elapsed)
        return arrived

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
    call_id: str = ""  # set on steps sent ahead (their order on the replica)


def _prefill_groups(members: list[Member], max_tokens: int) -> list[list[Member]]:
    """Consecutive groups of members whose prompts fit `max_tokens` (a larger one goes alone)."""
    groups: list[list[Member]] = []
    used = max_tokens
    for m in members:
        size = len(m.request.input_ids)
        if used + size > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(m)
        used += size
    return groups


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
