"""`ReplicaCore`: the one table from a call (`messages.py`) to what the replica does for it.

```
 edge (rpcs.py) ─ Call ─► placement ─► ReplicaCore
                                         ENGINE lane: engine_work(call, deadline) ─► one work item
                                                      (the engine thread runs it; the deadline is
                                                       checked as it starts)
                                         SERVICE lane: run(call, ctx) on the calling thread ─►
                                                      MigrationCalls / WeightCalls / facts
```
The same core serves both placements: in the replica process the edge's gRPC threads call it
directly (`local.py`); behind the front process the engine thread and the channel's threads call
it with the calls they read (`lanes.py`). Nothing here knows about protobuf or grpc.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from replica.cluster import ReplicaCluster
from replica.config import ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.types import HealthState
from replica.engine.warmup import warmup
from replica.engine.worker import EngineWorker
from replica.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ReplicaError,
    ShuttingDown,
)
from replica.links import PeerLink, connect_peers
from replica.params.store import ParamStore
from replica.server import messages as m
from replica.server.calls import CallContext
from replica.server.migration_calls import MigrationCalls
from replica.server.shared import ServerState
from replica.server.weight_calls import WeightCalls
from transfer.core import Deadline

log = logging.getLogger(__name__)

# Calls that compute layer by layer (zig-zag scaling): they would run rank 0's shard only, so a
# tensor-parallel replica refuses them (replica/tp/README.md). KV migrations and weight operations run
# on every rank (replica/tp/kvmove.py, replica/tp/weights.py).
TP_REFUSED: frozenset[type[m.Call]] = frozenset({m.PipelinedPrefill, m.ZagPrefill, m.Relay})


EngineHandler = Callable[[Engine, Any], Any]
ServiceHandler = Callable[[Any, CallContext], Any]


def as_replica_error(exc: BaseException) -> ReplicaError:
    """The error a caller gets: a ReplicaError as it is, anything else (a bug of ours) INTERNAL."""
    if isinstance(exc, ReplicaError):
        return exc
    log.error("a call failed unexpectedly", exc_info=exc)
    return ReplicaError(f"{type(exc).__name__}: {exc}")


class ReplicaCore:
    """The calls of one replica: an engine-lane and a service-lane table over shared state."""

    def __init__(self, config: ReplicaConfig, worker: EngineWorker) -> None:
        self.config = config
        self.worker = worker
        self.shared = ServerState(config, worker)
        self.instance = secrets.token_hex(8)  # Info's `instance`: new with each process (each core)
        self.weights = WeightCalls(self.shared)
        self.migration = MigrationCalls(self.shared)
        fraction = None if config.num_blocks is not None else config.kv_memory_fraction
        self._engine_calls: dict[type[m.Call], EngineHandler] = {
            m.Decode: lambda e, c: e.decode(c.inputs),
            m.Prefill: lambda e, c: e.prefill(c.batch, c.chunk_tokens),
            m.PrefillChunk: lambda e, c: e.prefill_chunk(c.batch_id, c.chunk_tokens),
            m.Filter: lambda e, c: e.filter(c.batch_id, c.keep),
            m.Clear: lambda e, c: e.clear(c.batch_id),
            m.Warmup: lambda e, c: warmup(e, c.spec, fraction),
        }
        w, mig = self.weights, self.migration
        self._service_calls: dict[type[m.Call], ServiceHandler] = {
            m.Health: lambda c, ctx: self.health(),
            m.Info: lambda c, ctx: self.info(),
            m.Discover: lambda c, ctx: self.discover(),
            m.ConnectPeers: lambda c, ctx: self.connect_peers(c.peers, ctx),
            m.Migrate: mig.migrate,
            m.Immigrate: mig.immigrate,
            m.MigratePartial: mig.migrate_partial,
            m.ImmigratePartial: mig.immigrate_partial,
            m.MigratingPrefill: mig.migrating_prefill,
            m.PipelinedPrefill: w.pipelined_prefill,
            m.ZagPrefill: w.zag_prefill,
            m.Relay: w.relay,
            m.LoadParams: w.load_params,
            m.SendParams: w.send_params,
            m.RecvParams: w.recv_params,
            m.Broadcast: w.broadcast,
            m.WaitRdmaDone: lambda c, ctx: w.wait_rdma_done(ctx),
            m.ResetStatus: lambda c, ctx: w.reset_status(),
            m.SetStatusReady: lambda c, ctx: w.set_status_ready(),
        }

    def attach(self, engine: Engine, params: ParamStore, cluster: ReplicaCluster | None) -> None:
        """Model loaded, fabric up: wire the weight calls, then let the engine calls through."""
        self.shared.cluster = cluster
        self.weights.attach(engine, params)
        self.shared.engine = engine  # last: engine calls answer "still loading" until everything is wired

    @property
    def engine(self) -> Engine | None:
        """The engine once the model is loaded (None before)."""
        return self.shared.engine

    # ------------------------------------------------------------------------------ dispatch
    def engine_work(self, call: m.Call, deadline: float | None) -> Callable[[], Any]:
        """An ENGINE-lane call as the function its work item runs on the engine thread."""
        handler = self._engine_calls.get(type(call))
        if handler is None:
            raise InvalidArgument(f"{type(call).__name__} is not an engine call")

        def run() -> Any:
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded("the call's deadline passed before the engine started it")
            engine = self.shared.engine
            if engine is None:
                raise FailedPrecondition("the model is still loading")
            return handler(engine, call)

        return run

    def run(self, call: m.Call, ctx: CallContext) -> Any:
        """Run any call on this thread (an ENGINE-lane one waits for its work item)."""
        ctx.check_started_in_time()
        if self.config.tp > 1 and type(call) in TP_REFUSED:
            raise FailedPrecondition(
                f"{type(call).__name__} is not supported by a tensor-parallel replica "
                f"(--tp {self.config.tp}): "
                "layer-by-layer (zig-zag) prefills would run one rank's shard only"
            )
        handler = self._service_calls.get(type(call))
        if handler is not None:
            return handler(call, ctx)
        work = self.engine_work(call, ctx.deadline)
        return self.worker.call(work, ctx.remaining())

    def connect_peers(self, peers: tuple[int, ...], ctx: CallContext) -> tuple[PeerLink, ...]:
        """ConnectPeers: warm the fabric's connections with `peers` by the call's deadline (else
        `--transfer-timeout`)."""
        cluster = self.shared.cluster
        if cluster is None:
            raise FailedPrecondition("this replica has no fabric yet (the model is still loading)")
        remaining = ctx.remaining()
        deadline = Deadline.after(self.config.transfer_timeout if remaining is None else remaining)
        return connect_peers(cluster.fabric, cluster.table, cluster.rank, peers, deadline)

    # --------------------------------------------------------------------------- facts
    def info(self) -> m.ReplicaInfo:
        """The engine's facts, read on the calling thread: every one is a single read the engine
        thread's updates cannot tear, so a poll answers while a long prefill runs."""
        engine = self.shared.engine
        if engine is None:
            raise FailedPrecondition("the model is still loading")
        cluster = self.shared.cluster
        state = self.weights.state
        return m.ReplicaInfo(engine.info(), self.config.rank, tp_size=self.config.tp,
                             fabric=cluster.kind if cluster is not None else "",
                             weights_model=state.params.model_name if state is not None else "",
                             host_copies=tuple(state.params.host_copies()) if state is not None else (),
                             instance=self.instance)

    def health(self) -> HealthState:
        """loading until the model is built; then serving / inactive / loading by weight readiness
        (UNAVAILABLE once a tensor-parallel group has lost a rank)."""
        if not self.worker.alive:
            raise ShuttingDown("the engine thread is not running")
        if self.config.tp > 1 and self.shared.engine is not None:
            from replica.tp.runner import check_group  # imported here: a simulated replica has no torch

            check_group(self.shared.engine.runner)
        return HealthState.LOADING if self.shared.engine is None else self.weights.health()

    def discover(self) -> m.Discovery:
        """This replica's URL(s) and the rank table."""
        cluster = self.shared.cluster
        if cluster is None:
            raise FailedPrecondition("the model is still loading (the fabric starts after it)")
        return m.Discovery(tuple(cluster.urls()), cluster.ranks_view_json())

