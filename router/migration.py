"""The migration queue: prefilled batches handed off as tasks, and the moves strategies are made of.

```
 prefill loop of P ─ spawn(P, strategy.hand_off(moves, P, batch)) ─► one task per batch
                        reserve(P, pages, …) ─► D (waits for an inbound slot and pages on D)
                        transfer_kv(P, D, batch)   Migrate on P ‖ Immigrate on D
                        arrive(D, batch, …) ─► D.inbox      decode_here(P, batch) ─► P.inbox
```
`outbound` counts a source's hand-offs in flight (a prefill loop takes no new batch past
`max_pending_migrations`), `inbound` and `promised` count reservations on a destination (at most
`max_inbound_migrations` at once). Strategies (`router/strategies/`) decide which moves to make;
this module knows none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol, cast

from router.batches import Arrived, LiveBatch, Member, migrated_blocks
from router.errors import ReplicaCallError, ReplicaUnavailable
from router.lifecycle import Requests
from router.metrics import RouterMetrics
from router.registry import ReplicaHandle, Replicas
from router.replicas import ReplicaState, State
from router.scaling.rates import Rates
from router.types import BatchId, CachedBatch, ReplicaId
from router.wakeup import Wakeups

log = logging.getLogger("pdcluster.router")

# Roles in which a replica decodes the batches it prefilled itself.
LOCAL_ROLES = (State.DECODE, State.MUTATING_TO_DECODE, State.COLOCATED)

Chooser = Callable[[Sequence[ReplicaState], int, int], "ReplicaState | None"]
"""(candidates: the decode replicas but the source, pages needed, inbound bound) → the destination,
or None while none fits."""


class Abandoned(Exception):
    """The batch's source died or its requests went away while it waited for a destination."""


class MigrationFailed(Exception):
    """Migrate ‖ Immigrate failed; `errors` are the calls' errors (not a cancelled wait)."""

    def __init__(self, errors: Sequence[Exception]) -> None:
        super().__init__(str(errors[0]) if errors else "migration failed")
        self.errors = list(errors)


class Host(Protocol):
    """What the migration queue asks of the cluster."""

    def mark_dead(self, rid: ReplicaId, reason: str) -> None:
        """The replica is gone: stop its loop and re-run every request it held."""
        ...

    def on_error(self, handle: ReplicaHandle, exc: ReplicaCallError, members: Iterable[Member]) -> None:
        """A call on `handle` failed: re-run or fail these requests by what failed."""
        ...

    def settle_roles(self) -> None:
        """Keep the roles the cluster needs (a prefill replica in a disaggregated cluster)."""
        ...

    def decode_preference(self, live: LiveBatch, receivers: Sequence[ReplicaState], need: int,
                          chosen: ReplicaState) -> ReplicaState:
        """The routing rule's say on a batch's destination (`chosen` by the strategy): a receiver
        that fits the batch and holds more of its prompts' prefix, or `chosen`."""
        ...

    def kv_arrived(self, replica: ReplicaHandle, live: LiveBatch) -> None:
        """A batch's prompt KV is on `replica` now (the prefix index learns what it holds)."""
        ...


class Migrations:
    """Hand-off tasks, destination reservations and the moves of a batch between replicas."""

    def __init__(self, host: Host, replicas: Replicas, requests: Requests, wakeups: Wakeups,
                 metrics: RouterMetrics, clock: Callable[[], float], max_inbound: int,
                 kv_bytes_per_token: int = 0, rates: Rates | None = None) -> None:
        self.host = host
        self.replicas = replicas
        self.requests = requests
        self.wakeups = wakeups
        self.metrics = metrics
        self.clock = clock
        self.max_inbound = max_inbound
        self.kv_bytes_per_token = kv_bytes_per_token
        self.rates = rates or Rates()
        self.tasks: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()

    # ---- tasks -----------------------------------------------------------------------------------

    def spawn(self, src: ReplicaHandle, job: Coroutine[Any, Any, None]) -> None:
        """Run a hand-off from `src` as a task of the queue (counted in `src`'s outbound)."""
        src.state.outbound += 1
        task = asyncio.create_task(self._guarded(src, job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guarded(self, src: ReplicaHandle, job: Awaitable[None]) -> None:
        try:
            await job
        except Abandoned:
            pass
        except Exception:
            log.exception("migration from replica %s failed", src.id)
        finally:
            src.state.outbound -= 1
            self.wakeups.pages(src.id)  # an outbound slot, and the pages the batch held there

    # ---- destinations ------------------------------------------------------------------------------

    async def reserve(self, src: ReplicaHandle, need: int, live: LiveBatch | None, choose: Chooser,
                      wait_for_decode: bool) -> ReplicaHandle | None:
        """Wait for a destination chosen by `choose` and reserve `need` pages on it.

        None = decode on `src` itself: it became a decoding replica meanwhile, or the cluster has no
        decode replica (unless `wait_for_decode`: the strategy makes decode replicas itself).
        Raises `Abandoned` when `src` died or every request of `live` went away.
        """
        while True:
            if not src.state.alive or (live is not None and not live.wanted_ids()):
                raise Abandoned
            if src.state.role in LOCAL_ROLES:
                return None
            token = self.wakeups.moves.token()
            receivers = self.replicas.receivers(src)
            chosen = choose(receivers, need, self.max_inbound)
            if chosen is not None and live is not None and chosen.role is State.DECODE:
                chosen = self.host.decode_preference(live, receivers, need, chosen)
            if chosen is not None:
                chosen.inbound += 1
                chosen.promised += need
                return self.replicas[chosen.id]
            if not self.replicas.has_decode() and not wait_for_decode:
                return None
            await self.wakeups.moves.wait(token)

    def unreserve(self, dst: ReplicaHandle, need: int) -> None:
        """The reservation made by `reserve` is over (the batch arrived or failed)."""
        dst.state.inbound -= 1
        dst.state.promised -= need
        self.wakeups.pages(dst.id)

    # ---- moves -----------------------------------------------------------------------------------

    def decode_here(self, src: ReplicaHandle, live: LiveBatch) -> None:
        """Decode the batch where it is: `src` became a decode replica, or there is no other."""
        local = "mutate" if src.state.role is not State.PREFILL else "colocated"
        for m in live.members.values():
            m.state.decoding(src.id, local)
        src.inbox.append(Arrived(live, {}))
        self.wakeups.replica(src.id)

    async def transfer_kv(self, src: ReplicaHandle, dst: ReplicaHandle, live: LiveBatch) -> CachedBatch:
        """Migrate on `src` ‖ Immigrate on `dst`; the batch as cached on `dst`, or `MigrationFailed`."""
        spec = live.spec()
        migrate = asyncio.ensure_future(src.client.migrate(spec, src.ranks, dst.ranks))
        immigrate = asyncio.ensure_future(dst.client.immigrate(spec, src.ranks, dst.ranks))
        self.pair(src, migrate, dst, immigrate)
        sent, got = await asyncio.gather(migrate, immigrate, return_exceptions=True)
        if isinstance(sent, BaseException) or isinstance(got, BaseException):
            # (a receiver's wait cancelled because its sender is gone is no error of its own)
            raise MigrationFailed([e for e in (sent, got) if isinstance(e, Exception)])
        return got

    async def transfer_halves(self, first: ReplicaHandle, second: ReplicaHandle, dst: ReplicaHandle,
                              live: LiveBatch, split: int) -> CachedBatch:
        """Layers [0, split) from `first` and [split, L) from `second` into one batch on `dst`
        (MigratePartial ‖ ImmigratePartial for each half); the decode-ready batch, or `MigrationFailed`."""
        spec = live.spec()
        calls = [
            first.client.migrate_partial(spec, True, split, first.ranks, dst.ranks),
            dst.client.immigrate_partial(spec, True, split, first.ranks, dst.ranks),
            second.client.migrate_partial(spec, False, split, second.ranks, dst.ranks),
            dst.client.immigrate_partial(spec, False, split, second.ranks, dst.ranks),
        ]
        tasks = [asyncio.ensure_future(c) for c in calls]
        self.pair(first, tasks[0], dst, tasks[1])
        self.pair(second, tasks[2], dst, tasks[3])
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors or any(isinstance(r, BaseException) for r in results):
            raise MigrationFailed(errors)
        return cast(CachedBatch, results[3])

    def arrive(self, dst: ReplicaHandle, live: LiveBatch, strategy: str, seconds: float) -> None:
        """A batch's KV is on `dst`: account its pages, record the routes, hand it to its loop.

        Each route gets its own request's KV bytes (the pages of its prompt, less those the receiver
        held already in its prefix cache: the rest of its reservation holds nothing yet) and the
        batch's transfer time.
        """
        dst.state.hold(live.pages())
        self.host.kv_arrived(dst, live)
        lasts = {}
        page_bytes = live.block_size * self.kv_bytes_per_token
        moved = 0
        for rid, m in live.members.items():
            reused = live.cached.reused(rid) // live.block_size
            nbytes = max(migrated_blocks(m, live.block_size) - reused, 0) * page_bytes
            moved += nbytes
            m.state.migrated(dst.id, strategy, nbytes, seconds)
            if m.state.generated:
                lasts[rid] = m.state.generated[-1]
        self.metrics.migration(strategy, moved, seconds)
        self.rates.migrated(sum(len(m.request.input_ids) for m in live.members.values()), seconds)
        dst.inbox.append(Arrived(live, lasts))
        self.wakeups.replica(dst.id)

    async def prune(self, handle: ReplicaHandle, live: LiveBatch) -> LiveBatch | None:
        """Filter the batch on `handle` to the requests still wanted (a failure re-runs or fails them)."""
        try:
            pruned = await handle.prune(live)
        except ReplicaCallError as exc:
            self.host.on_error(handle, exc, [m for m in live.members.values() if m.wanted])
            return None
        if pruned is not live:
            self.wakeups.pages(handle.id)
        return pruned

    async def clear(self, handle: ReplicaHandle, batch_id: BatchId) -> None:
        """Free a batch on `handle`, whatever it answers (it may hold nothing of it any more)."""
        with contextlib.suppress(ReplicaCallError):
            await handle.client.clear_cache(batch_id)

    def pair(self, src: ReplicaHandle, send: asyncio.Future[Any], dst: ReplicaHandle,
             receive: asyncio.Future[Any]) -> None:
        """Tie the two calls of one transfer: a side whose own call fails as unreachable is dead at
        once, and the other side's call is cancelled (the replica ends its part and frees what it
        held for it) rather than left to wait for its deadline with the batch's requests waiting —
        a gone sender sends no header, a gone receiver answers none (the sender would wait for its
        `have`: a receiver restarted on its address takes the connection but never the batch)."""
        for handle, call, other in ((src, send, receive), (dst, receive, send)):
            call.add_done_callback(functools.partial(self._one_side_done, handle, other=other))

    def _one_side_done(self, handle: ReplicaHandle, call: asyncio.Future[Any], other: asyncio.Future[Any]
                       ) -> None:
        if _gone(call):
            self.host.mark_dead(handle.id, str(call.exception()))
            if not other.done():
                other.cancel()

    def warn_once(self, what: str, errors: Sequence[BaseException]) -> None:
        """Say once per kind that the replicas lack a migration RPC (the batches fall back)."""
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s migration is not implemented by the replicas (%s): falling back to "
                        "recompute", what, errors[0])

    def now(self) -> float:
        """The router's clock."""
        return self.clock()


def _gone(call: asyncio.Future[Any]) -> bool:
    """The call failed because its replica could not be reached (UNAVAILABLE without a peer cause)."""
    if call.cancelled():
        return False
    return isinstance(call.exception(), ReplicaUnavailable)  # PeerFailed is not one: the caller is alive
