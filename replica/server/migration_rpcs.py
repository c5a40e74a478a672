"""The KV migration RPCs of a replica (a collaborator `ReplicaServicer` delegates to).

```
 Migrate / MigratePartial ──────► Migrations.migrate (sender: take batch, send, free)
 Immigrate ─────────────────────► Migrations.immigrate (receiver: admit, receive, adopt)
 ImmigratePartial FIRST/SECOND ─► PartialImmigrations.first / .second (one batch, two senders)
 PrefillV2 MIGRATE[_PROGRESSIVE] ► MigratingPrefill.run (prefill here, KV to pipe_peer)
```
`src`/`dst`/`pipe_peer` are global ranks indexed by TP rank; a replica is TP degree 1, so each list
names exactly one peer (a list of another length is INVALID_ARGUMENT). A sender's `src`, when given,
must name this replica (and a receiver's `dst`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from protos import generate_pb2 as pb
from replica.engine.engine import Engine
from replica.errors import FailedPrecondition, InvalidArgument
from replica.migration.manager import Migrations, Route
from replica.migration.partial import PartialImmigrations
from replica.migration.plan import LayerHalf
from replica.migration.prefill import MigratingPrefill
from replica.server import convert
from replica.server.shared import ServerState

_NO_DEADLINE = 10.0**7  # grpc's "no deadline" shows up as an enormous time_remaining
_HALVES: dict[int, LayerHalf] = {
    pb.PARTIAL_CASE_FIRST: LayerHalf.FIRST,
    pb.PARTIAL_CASE_SECOND: LayerHalf.SECOND,
}


@dataclass(frozen=True)
class _Parts:
    engine: Engine
    full: Migrations
    partial: PartialImmigrations
    prefill: MigratingPrefill


class MigrationRpcs:
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
                parts = _Parts(engine, full, PartialImmigrations(full), MigratingPrefill(full))
                self._parts_built = parts
            return parts

    def _me(self, ranks: Sequence[int], field: str) -> None:
        """`field` (this side's list) is empty or names this replica."""
        cluster = self.shared.cluster
        mine = cluster.rank if cluster is not None else self.shared.config.rank
        if ranks and list(ranks) != [mine]:
            raise InvalidArgument(f"{field} {list(ranks)} should name this replica, rank {mine}")

    def Migrate(self, request: pb.MigrateRequest, context: grpc.ServicerContext) -> pb.MigrateResponse:
        """Sender: move every layer of the batch's KV to `dst[0]`, then free it here."""
        parts = self._parts()
        self._me(request.src, "src")
        spec = convert.batch_from_pb(request.batch)
        route = Route(_one(request.dst, "dst"))
        info = parts.full.migrate(spec, route, _remaining(context), _after_reply(context))
        return pb.MigrateResponse(batch=convert.cached_batch_to_pb(info))

    def Immigrate(self, request: pb.ImmigrateRequest, context: grpc.ServicerContext) -> pb.ImmigrateResponse:
        """Receiver: admit the batch, receive every layer from `src[0]`, return it decode-ready."""
        parts = self._parts()
        self._me(request.dst, "dst")
        spec = convert.batch_from_pb(request.batch)
        peer = _one(request.src, "src")
        cancelled, after_reply = _cancelled(context), _after_reply(context)
        info = parts.full.immigrate(spec, peer, _remaining(context), cancelled, after_reply)
        return pb.ImmigrateResponse(batch=convert.cached_batch_to_pb(info))

    def MigratePartial(
        self, request: pb.MigratePartialRequest, context: grpc.ServicerContext
    ) -> pb.MigrateResponse:
        """Sender of one half: layers [0, num_layer) (FIRST) or [num_layer, L) (SECOND); frees the batch."""
        parts = self._parts()
        self._me(request.src, "src")
        route = Route(_one(request.dst, "dst"), _half(request.fst_or_snd), request.num_layer)
        spec = convert.batch_from_pb(request.batch)
        info = parts.full.migrate(spec, _checked(route, parts), _remaining(context), _after_reply(context))
        return pb.MigrateResponse(batch=convert.cached_batch_to_pb(info))

    def ImmigratePartial(
        self, request: pb.ImmigratePartialRequest, context: grpc.ServicerContext
    ) -> pb.ImmigrateResponse:
        """Receiver of one half; SECOND waits for FIRST's batch and returns it decode-ready."""
        parts = self._parts()
        self._me(request.dst, "dst")
        route = _checked(Route(_one(request.src, "src"), _half(request.fst_or_snd), request.num_layer), parts)
        spec = convert.batch_from_pb(request.batch)
        receive = parts.partial.first if route.half is LayerHalf.FIRST else parts.partial.second
        info = receive(spec, route.peer, route.split, _remaining(context), _cancelled(context))
        return pb.ImmigrateResponse(batch=convert.cached_batch_to_pb(info))

    def migrate_prefill(
        self, request: pb.PrefillV2Request, context: grpc.ServicerContext
    ) -> pb.PrefillV2Response:
        """PrefillV2 with MIGRATE or MIGRATE_PROGRESSIVE: prefill here, KV to `pipe_peer[0]`."""
        parts = self._parts()
        progressive = bool(request.forward_case & pb.MIGRATE_PROGRESSIVE)
        spec = convert.batch_from_pb(request.batch)
        peer = _one(request.pipe_peer, "pipe_peer")
        result = parts.prefill.run(spec, peer, progressive, _remaining(context))
        response = pb.PrefillV2Response(
            forward_ns=result.forward_ns, decode_ns=result.decode_ns, total_ns=result.total_ns
        )
        convert.fill_step(response, result)
        return response


def _one(ranks: Sequence[int], field: str) -> int:
    """The single peer of a TP-degree-1 list."""
    if len(ranks) != 1:
        raise InvalidArgument(f"{field} must name exactly one rank (TP degree 1), got {list(ranks)}")
    return int(ranks[0])


def _half(case: int) -> LayerHalf:
    if case not in _HALVES:
        raise InvalidArgument(f"fst_or_snd must be PARTIAL_CASE_FIRST or PARTIAL_CASE_SECOND, got {case}")
    return _HALVES[case]


def _checked(route: Route, parts: _Parts) -> Route:
    layers = parts.engine.runner.num_layers
    if not 0 < route.split < layers:
        raise InvalidArgument(f"num_layer must be in [1, {layers - 1}] (partial), not {route.split}")
    return route


def _cancelled(context: grpc.ServicerContext) -> threading.Event:
    """Set when the call ends for any reason: a receiver still waiting then stops (its caller is gone)."""
    event = threading.Event()
    if not context.add_callback(event.set):
        event.set()  # the call already ended
    return event


def _after_reply(context: grpc.ServicerContext) -> Callable[[Callable[[], None]], None]:
    """Runs a function once the call ended (its answer sent), or at once if it has ended already."""

    def defer(fn: Callable[[], None]) -> None:
        if not context.add_callback(fn):
            fn()

    return defer


def _remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds left of the call; None when the caller set no deadline."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE else max(remaining, 0.0)
