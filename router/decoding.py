"""The decode side of a replica's loop: arrived batches merge into the running one, one DecodeV2
step at a time, with steps sent ahead while the batch goes on unchanged.

```
 inbox: Arrived (KV already here) ─┐                    ┌─► deliver (stream the step's tokens)
        Arrival.take (re-prefill) ─┴─► DecodeV2(running + arrived, their last tokens) ─► prune
```
Pipelined: while nothing arrived and every request is still wanted, up to `PIPELINE_DEPTH`
DecodeV2 calls are on the wire, the next ones sent before this step's tokens are streamed, so the
replica's engine never waits for the round trip or for the router's work. The replica keeps the
sampled tokens and skips finished requests; a step that needs a FilterBatch or a merge waits until
the steps sent ahead are collected.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from router.batches import Arrived, InboxItem, LiveBatch, Member, prefill_groups
from router.cluster import Cluster
from router.errors import ReplicaCallError, ReplicaUnavailable
from router.registry import ReplicaHandle
from router.replicas import ReplicaState
from router.types import BatchId, RequestId, StepResult
from router.wakeup import Wakeups

# DecodeV2 calls a decode loop keeps on the wire while its batch goes on unchanged: the replica
# has the next step queued when one ends, so neither the round trip (~1 ms of gRPC client to
# client on the 2-core dev box) nor the router's streaming of the previous step sits between two
# steps. With 2, a 0.4–1 ms step was still bound by the round trip; 3 gave +17–20% decode tokens/s
# over gRPC at batch 1 and 8 (`pdcluster bench replica`), 4 no more.
PIPELINE_DEPTH = 3

Prefill = Callable[[list[Member], BatchId], Awaitable[LiveBatch | None]]
"""Prefills members' current runs on this replica as a new batch (not from the queue)."""


class DecodeLoop:
    """Decode steps of one replica; also the `batches.DecodeSide` its inbox items are taken with."""

    def __init__(self, cluster: Cluster, handle: ReplicaHandle, wakeups: Wakeups, prefill: Prefill,
                 max_prefill_tokens: int, hold_back: Callable[[], bool] = lambda: False) -> None:
        self.cluster = cluster
        self.h = handle
        self.wakeups = wakeups
        self._prefill = prefill
        self._max_prefill_tokens = max_prefill_tokens
        # other work of this replica's loop that must get between two steps (a colocated prefill):
        # no step is sent ahead while it says so
        self._hold_back = hold_back
        self._flights: collections.deque[_InFlight] = collections.deque()  # decode steps on the wire
        self._call_prefix = secrets.token_hex(6)  # names this loop's pipelined calls (unique per run)
        self._calls = 0

    @property
    def in_flight(self) -> bool:
        """Steps sent ahead are still on the wire (they are collected before anything else)."""
        return bool(self._flights)

    # ---- DecodeSide ------------------------------------------------------------------------------

    @property
    def replica(self) -> ReplicaState:
        """This replica's state."""
        return self.h.state

    async def prefill_here(self, members: list[Member]) -> list[LiveBatch]:
        """Prefill these runs here, in groups under the prefill token budget (prompt + the tokens
        generated so far can exceed the budget the batch was cut to)."""
        batches = []
        for group in prefill_groups(members, self._max_prefill_tokens):
            live = await self._prefill(group, self.cluster.new_batch_id())
            if live is not None:
                batches.append(live)
        return batches

    def now(self) -> float:
        """The router's clock."""
        return self.cluster.moves.now()

    def record_migration(self, strategy: str, nbytes: int, seconds: float) -> None:
        """Count one hand-off in the metrics."""
        self.cluster.moves.metrics.migration(strategy, nbytes, seconds)

    # ---- steps -----------------------------------------------------------------------------------

    async def step(self) -> bool:
        """Merge what arrived into the running batch and run one decode step; True when it did."""
        if not self._flights:
            batches, lasts = await self._gather_batches()
            if not batches:
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
            self.cluster.on_error(self.h, exc, flight.members.values())
            return True
        await self._after_step(result, flight.members)
        return True

    async def _after_step(self, result: StepResult, members: dict[RequestId, Member]) -> None:
        """Send the next steps when they can go now, stream this step's tokens, then prune."""
        self.cluster.step_done(self.h, result)
        if result.batch is None:
            await self._settle_flights()  # steps sent ahead find the batch gone: nothing was run
            self.cluster.deliver(result, members)
            self.h.state.release(members)
            self.h.running = None
            self.wakeups.pages(self.h.id)  # its pages are free (a step that only streamed tokens
            return  # changes nothing another task waits for: no wake-up then)
        live = LiveBatch.of(result.batch, list(members.values()), self.h.block_size)
        self.h.running = live
        if not self.h.inbox and len(live.wanted_ids()) == len(live.members) and not self._hold_back():
            while len(self._flights) < PIPELINE_DEPTH:
                self._send_ahead(live)
            await asyncio.sleep(0)  # the calls' sends run before the streams woken by deliver
            self.cluster.deliver(result, members)
            return
        self.cluster.deliver(result, members)
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
            for arrived in await self._take(item):
                live = await self.prune(arrived.batch)
                if live is not None:
                    for m in live.members.values():
                        m.state.decoding(self.h.id)
                    batches.append(live)
                    lasts.append(dict(arrived.last_tokens))
        return batches, lasts

    async def _take(self, item: InboxItem) -> list[Arrived]:
        return [item] if isinstance(item, Arrived) else await item.take(self)

    async def _drop_batches(self, batches: list[LiveBatch]) -> None:
        """After a failed step, free what the replica may still hold for these batches."""
        for b in batches:
            with contextlib.suppress(ReplicaCallError):
                await self.h.client.clear_cache(b.id)
            self.h.state.release(b.members)
        self.h.running = None
        self.wakeups.pages(self.h.id)

    async def prune(self, live: LiveBatch) -> LiveBatch | None:
        """Drop finished, cancelled and stale requests from a cached batch (the replica frees them)."""
        try:
            pruned = await self.h.prune(live)
        except ReplicaCallError as exc:
            self.cluster.on_error(self.h, exc, [m for m in live.members.values() if m.wanted])
            return None
        if pruned is not live:
            self.wakeups.pages(self.h.id)
        return pruned


@dataclass
class _InFlight:
    """A decode step on the wire: its batches, their members, and the call's result."""

    batches: list[LiveBatch]
    members: dict[RequestId, Member]
    result: Coroutine[Any, Any, StepResult]
    call_id: str = ""  # set on steps sent ahead (their order on the replica)


def _last_tokens(batch: LiveBatch, last: dict[RequestId, int]) -> list[int]:
    """The `last_iter_tokens` ids of one batch, in its request order (empty: nothing to append)."""
    ids = [last[rid] for rid in batch.cached.request_ids if rid in last]
    return ids if len(ids) == len(batch.cached.request_ids) else []
