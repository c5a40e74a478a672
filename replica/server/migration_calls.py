"""The KV migration calls of a replica (the core's table sends them here).

```
 Migrate / MigratePartial ──────► Migrations.migrate (sender: take batch, send, free)
 Immigrate ─────────────────────► Migrations.immigrate (receiver: admit, receive, adopt)
 ImmigratePartial FIRST/SECOND ─► PartialImmigrations.first / .second (one batch, two senders)
 MigratingPrefill ──────────────► MigratingPrefill.run (prefill here, KV to pipe_peer)
```
`src`/`dst`/`pipe_peer` are global ranks indexed by TP rank: one rank (the group's rank 0; its
other ranks follow it in the rank table) or, under `--tp N`, the group's N contiguous ranks (another
list is INVALID_ARGUMENT). Under `--tp N` tp_rank r moves its own shard with the peer's rank + r
(`replica/tp/kvmove.py`). A sender's `src`, when given,
must name this replica (and a receiver's `dst`). Every side gets the call's cancellation: a
receiver stops waiting and a sender aborts its transfer (its pages freed) once the caller is gone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from replica.engine.engine import Engine
from replica.engine.types import CachedBatchInfo, ImmigratedBatch, StepResult
from replica.errors import FailedPrecondition, InvalidArgument
from replica.migration.manager import Migrations, Route
from replica.migration.partial import PartialImmigrations
from replica.migration.plan import LayerHalf
from replica.migration.prefill import MigratingPrefill as PrefillSender
from replica.server.calls import CallContext
from replica.server.messages import (
    Immigrate,
    ImmigratePartial,
    Migrate,
    MigratePartial,
    MigratingPrefill,
    PartialCase,
    PrefillCase,
)
from replica.server.shared import ServerState

_HALVES: dict[int, LayerHalf] = {PartialCase.FIRST: LayerHalf.FIRST, PartialCase.SECOND: LayerHalf.SECOND}


@dataclass(frozen=True)
class _Parts:
    engine: Engine
    full: Migrations
    partial: PartialImmigrations
    prefill: PrefillSender


class MigrationCalls:
    """Migrate, Immigrate, MigratePartial, ImmigratePartial and PrefillV2's MIGRATE cases."""

    def __init__(self, shared: ServerState) -> None:
        self.shared = shared
        self._parts_built: _Parts | None = None  # built on first use, rebuilt if the engine changes
        self._lock = threading.Lock()

    def _parts(self) -> _Parts:
        engine, cluster = self.shared.engine, self.shared.cluster
        if engine is None or cluster is None:
            raise FailedPrecondition("the model is still loading (migrations start with the fabric)")
        with self._lock:
            parts = self._parts_built
            if parts is None or parts.engine is not engine:
                full = Migrations(engine, self.shared.worker, cluster, self.shared.config.transfer_timeout)
                parts = _Parts(engine, full, PartialImmigrations(full), PrefillSender(full))
                self._parts_built = parts
            return parts

    def _me(self, ranks: Sequence[int], field: str) -> None:
        """`field` (this side's list) is empty or names this replica: its rank, or its group's ranks."""
        cluster = self.shared.cluster
        mine = cluster.rank if cluster is not None else self.shared.config.rank
        group = [mine + r for r in range(self.shared.config.tp)]
        if ranks and list(ranks) not in ([mine], group):
            raise InvalidArgument(f"{field} {list(ranks)} should name this replica, rank {mine} "
                                  f"(or its group's ranks {group})")

    def _one(self, ranks: Sequence[int], field: str) -> int:
        """The peer's rank 0 (its group's other ranks follow it in the table)."""
        return _one(ranks, field, self.shared.config.tp)

    def migrate(self, call: Migrate, ctx: CallContext) -> CachedBatchInfo:
        """Sender: move every layer of the batch's KV to `dst[0]`, then free it here."""
        parts = self._parts()
        self._me(call.src, "src")
        route = Route(self._one(call.dst, "dst"))
        return parts.full.migrate(call.batch, route, ctx.remaining(), ctx.after, ctx.cancellation)

    def immigrate(self, call: Immigrate, ctx: CallContext) -> ImmigratedBatch:
        """Receiver: admit the batch, receive every layer from `src[0]`, return it decode-ready."""
        parts = self._parts()
        self._me(call.dst, "dst")
        peer = self._one(call.src, "src")
        return parts.full.immigrate(call.batch, peer, ctx.remaining(), ctx.cancellation, ctx.after)

    def migrate_partial(self, call: MigratePartial, ctx: CallContext) -> CachedBatchInfo:
        """Sender of one half: layers [0, num_layer) (FIRST) or [num_layer, L) (SECOND); frees the batch."""
        parts = self._parts()
        self._me(call.src, "src")
        route = _checked(Route(self._one(call.dst, "dst"), _half(call.half), call.num_layer), parts)
        return parts.full.migrate(call.batch, route, ctx.remaining(), ctx.after, ctx.cancellation)

    def immigrate_partial(self, call: ImmigratePartial, ctx: CallContext) -> ImmigratedBatch:
        """Receiver of one half; SECOND waits for FIRST's batch and returns it decode-ready."""
        parts = self._parts()
        self._me(call.dst, "dst")
        route = _checked(Route(self._one(call.src, "src"), _half(call.half), call.num_layer), parts)
        receive = parts.partial.first if route.half is LayerHalf.FIRST else parts.partial.second
        return receive(call.batch, route.peer, route.split, ctx.remaining(), ctx.cancellation)

    def migrating_prefill(self, call: MigratingPrefill, ctx: CallContext) -> StepResult:
        """PrefillV2 with MIGRATE or MIGRATE_PROGRESSIVE: prefill here, KV to `pipe_peer[0]`."""
        parts = self._parts()
        progressive = bool(call.forward_case & PrefillCase.MIGRATE_PROGRESSIVE)
        peer = self._one(call.pipe_peer, "pipe_peer")
        return parts.prefill.run(call.batch, peer, progressive, ctx.remaining(), ctx.cancellation)


def _one(ranks: Sequence[int], field: str, tp: int = 1) -> int:
    """The peer's rank 0: a one-rank list, or (tp > 1) its group's `tp` contiguous ranks."""
    if ranks and (len(ranks) == 1 or list(ranks) == [ranks[0] + r for r in range(tp)]):
        return int(ranks[0])
    raise InvalidArgument(f"{field} must name one rank, or the {tp} contiguous ranks of a tensor-parallel "
                          f"group (--tp {tp}), got {list(ranks)}")


def _half(case: int) -> LayerHalf:
    if case not in _HALVES:
        raise InvalidArgument(f"fst_or_snd must be PARTIAL_CASE_FIRST or PARTIAL_CASE_SECOND, got {case}")
    return _HALVES[case]


def _checked(route: Route, parts: _Parts) -> Route:
    layers = parts.engine.runner.num_layers
    if not 0 < route.split < layers:
        raise InvalidArgument(f"num_layer must be in [1, {layers - 1}] (partial), not {route.split}")
    return route
