"""`ReplicaServicer`: thin gRPC handlers — convert, submit to the engine thread, convert back.

The weight / layer-level prefill RPCs and the KV migration RPCs live in two collaborators
(`self.weights: WeightRpcs`, `self.migration: MigrationRpcs`) that share `self.shared: ServerState`;
the servicer's methods for them delegate in one line each.

Handlers never touch engine state themselves: every call runs as one work item on the engine
thread and the handler waits for it with the call's deadline. A Prefill whose caller gave up while
it ran is undone (its batch dropped) on the engine thread, so nothing leaks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from replica.cluster import ReplicaCluster
from replica.config import ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.types import BatchId, HealthState, RequestId, StepResult
from replica.engine.warmup import warmup
from replica.engine.worker import EngineWorker
from replica.errors import FailedPrecondition, InvalidArgument, ShuttingDown
from replica.params.store import ParamStore
from replica.server import convert
from replica.server.migration_rpcs import MigrationRpcs
from replica.server.ordering import CallOrder
from replica.server.shared import ServerState
from replica.server.weights_rpcs import WeightRpcs

T = TypeVar("T")

_NO_DEADLINE = 10.0**7  # seconds; grpc's "no deadline" shows up as an enormous time_remaining


class ReplicaServicer(pb_grpc.TextGenerationServiceServicer):
    """The generate.v2 service of one replica."""

    def __init__(self, config: ReplicaConfig, worker: EngineWorker) -> None:
        self.config = config
        self.worker = worker
        self.shared = ServerState(config, worker)
        self.weights = WeightRpcs(self.shared)
        self.migration = MigrationRpcs(self.shared)
        self.address = f"{config.host}:{config.port}"
        self.order = CallOrder()  # pipelined DecodeV2 calls reach the engine in the caller's order

    def attach(self, engine: Engine, params: ParamStore, cluster: ReplicaCluster | None) -> None:
        """Model loaded, fabric up: wire the weight RPCs, then let the engine RPCs through."""
        self.shared.cluster = cluster
        self.weights.attach(engine, params)
        self.shared.engine = engine  # last: engine RPCs answer "still loading" until everything is wired

    @property
    def engine(self) -> Engine | None:
        """The engine once the model is loaded (None before)."""
        return self.shared.engine

    @property
    def cluster(self) -> ReplicaCluster | None:
        """The rank table and fabric, set with the engine."""
        return self.shared.cluster

    # ------------------------------------------------------------------------------- helpers
    def _run(
        self,
        context: grpc.ServicerContext,
        fn: Callable[[Engine], T],
        undo: Callable[[Engine, T], None] | None = None,
    ) -> T:
        engine = self.engine
        if engine is None:
            raise FailedPrecondition("the model is still loading")
        if undo is None:
            return self.worker.call(lambda: fn(engine), _deadline(context))
        result = self.worker.call(lambda: fn(engine), _deadline(context), lambda r: undo(engine, r))
        if not context.is_active():  # finished just as the caller gave up: nobody will get the result
            self.worker.submit(lambda: undo(engine, result))
        return result

    @property
    def health_state(self) -> HealthState:
        """loading until the model is built; then serving / inactive / loading by weight readiness."""
        return HealthState.LOADING if self.engine is None else self.weights.health()

    # ------------------------------------------------------------------------------ facts
    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        if not self.worker.alive:
            raise ShuttingDown("the engine thread is not running")
        return pb.HealthResponse(state=self.health_state.value)

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        info = self._run(context, lambda e: e.info())
        return convert.info_to_pb(info, self.config.rank, tp_size=1)

    def ServiceDiscovery(
        self, request: pb.ServiceDiscoveryRequest, context: grpc.ServicerContext
    ) -> pb.ServiceDiscoveryResponse:
        cluster = self.cluster
        if cluster is None:
            raise FailedPrecondition("the model is still loading (the fabric starts after it)")
        return pb.ServiceDiscoveryResponse(urls=cluster.urls(), ranks_view_in_json=cluster.ranks_view_json())

    # ------------------------------------------------------------------------- batch life
    def Warmup(self, request: pb.WarmupRequest, context: grpc.ServicerContext) -> pb.WarmupResponse:
        spec = convert.warmup_from_pb(request)
        fraction = None if self.config.num_blocks is not None else self.config.kv_memory_fraction
        tokens = self._run(context, lambda e: warmup(e, spec, fraction))
        return pb.WarmupResponse(max_supported_total_tokens=tokens)

    def _prefill(self, batch: pb.Batch, context: grpc.ServicerContext) -> StepResult:
        spec = convert.batch_from_pb(batch)
        return self._run(context, lambda e: e.prefill(spec), undo=_drop_prefilled)

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        result = self._prefill(request.batch, context)
        response = pb.PrefillResponse(
            forward_ns=result.forward_ns, decode_ns=result.decode_ns, total_ns=result.total_ns
        )
        convert.fill_step(response, result)
        return response

    def PrefillV2(self, request: pb.PrefillV2Request, context: grpc.ServicerContext) -> pb.PrefillV2Response:
        if request.forward_case & (pb.NAIVE_PP | pb.IMMIGRATE):  # only NAIVE_PP|IMMIGRATE is valid
            return self.weights.naive_pp_prefill(request, context)
        if request.forward_case & (pb.MIGRATE | pb.MIGRATE_PROGRESSIVE):
            return self.migration.migrate_prefill(request, context)
        if request.forward_case != pb.NORMAL:
            raise InvalidArgument(f"PrefillV2 forward_case {request.forward_case}: not a valid PrefillCase")
        result = self._prefill(request.batch, context)
        response = pb.PrefillV2Response(
            forward_ns=result.forward_ns, decode_ns=result.decode_ns, total_ns=result.total_ns
        )
        convert.fill_step(response, result)
        return response

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> pb.DecodeResponse:
        inputs = convert.decode_inputs_from_pb(request.batches)
        result = self._run(context, lambda e: e.decode(inputs))
        response = pb.DecodeResponse(
            forward_ns=result.forward_ns,
            decode_ns=result.decode_ns,
            total_ns=result.total_ns,
            concat_ns=result.concat_ns,
        )
        convert.fill_step(response, result)
        return response

    def DecodeV2(self, request: pb.DecodeV2Request, context: grpc.ServicerContext) -> pb.DecodeV2Response:
        deadline = _deadline(context)
        # A pipelined call (the router keeps several on the wire) is queued after the one it follows.
        with self.order.ordered(context.invocation_metadata(), deadline):
            inputs = convert.decode_inputs_from_pb(request.batches, request.last_iter_tokens)
            engine = self.engine
            if engine is None:
                raise FailedPrecondition("the model is still loading")
            item = self.worker.submit(lambda: engine.decode(inputs))
        result = self.worker.wait(item, deadline)
        response = pb.DecodeV2Response(total_ns=result.total_ns)
        convert.fill_step(response, result)
        return response

    def FilterBatch(
        self, request: pb.FilterBatchRequest, context: grpc.ServicerContext
    ) -> pb.FilterBatchResponse:
        keep = [RequestId(i) for i in request.request_ids]
        info = self._run(context, lambda e: e.filter(BatchId(request.batch_id), keep))
        return pb.FilterBatchResponse(batch=convert.cached_batch_to_pb(info))

    def ClearCache(
        self, request: pb.ClearCacheRequest, context: grpc.ServicerContext
    ) -> pb.ClearCacheResponse:
        batch_id = BatchId(request.id) if request.HasField("id") else None
        self._run(context, lambda e: e.clear(batch_id))
        return pb.ClearCacheResponse()

    # ----------------------------- weights and layer-level prefill (WeightRpcs)
    def LoadParams(
        self, request: pb.LoadParamsRequest, context: grpc.ServicerContext
    ) -> pb.LoadParamsResponse:
        return self.weights.LoadParams(request, context)

    def SendParams(
        self, request: pb.SendParamsRequest, context: grpc.ServicerContext
    ) -> pb.SendParamsResponse:
        return self.weights.SendParams(request, context)

    def RecvParams(
        self, request: pb.RecvParamsRequest, context: grpc.ServicerContext
    ) -> pb.RecvParamsResponse:
        return self.weights.RecvParams(request, context)

    def RdmaBroadcast(
        self, request: pb.BroadcastRequest, context: grpc.ServicerContext
    ) -> pb.BroadcastResponse:
        return self.weights.RdmaBroadcast(request, context)

    def NvlBroadcast(
        self, request: pb.BroadcastRequest, context: grpc.ServicerContext
    ) -> pb.BroadcastResponse:
        return self.weights.NvlBroadcast(request, context)

    def TanzBroadcast(
        self, request: pb.BroadcastRequest, context: grpc.ServicerContext
    ) -> pb.BroadcastResponse:
        return self.weights.TanzBroadcast(request, context)

    def WaitRdmaDone(
        self, request: pb.WaitRdmaDoneRequest, context: grpc.ServicerContext
    ) -> pb.WaitRdmaDoneResponse:
        return self.weights.WaitRdmaDone(request, context)

    def ResetStatus(
        self, request: pb.ResetStatusRequest, context: grpc.ServicerContext
    ) -> pb.ResetStatusResponse:
        return self.weights.ResetStatus(request, context)

    def SetStatusReady(
        self, request: pb.SetStatusReadyRequest, context: grpc.ServicerContext
    ) -> pb.SetStatusReadyResponse:
        return self.weights.SetStatusReady(request, context)

    def ZagPrefill(
        self, request: pb.ZagPrefillRequest, context: grpc.ServicerContext
    ) -> pb.PrefillV2Response:
        return self.weights.ZagPrefill(request, context)

    def Relay(self, request: pb.RelayRequest, context: grpc.ServicerContext) -> pb.RelayResponse:
        return self.weights.Relay(request, context)

    # --------------------------------------------- KV migration (MigrationRpcs)
    def Migrate(self, request: pb.MigrateRequest, context: grpc.ServicerContext) -> pb.MigrateResponse:
        return self.migration.Migrate(request, context)

    def Immigrate(self, request: pb.ImmigrateRequest, context: grpc.ServicerContext) -> pb.ImmigrateResponse:
        return self.migration.Immigrate(request, context)

    def MigratePartial(
        self, request: pb.MigratePartialRequest, context: grpc.ServicerContext
    ) -> pb.MigrateResponse:
        return self.migration.MigratePartial(request, context)

    def ImmigratePartial(
        self, request: pb.ImmigratePartialRequest, context: grpc.ServicerContext
    ) -> pb.ImmigrateResponse:
        return self.migration.ImmigratePartial(request, context)


def _deadline(context: grpc.ServicerContext) -> float | None:
    """Seconds left of the call; None when the caller set no deadline (grpc reports a huge number)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE else max(remaining, 0.0)


def _drop_prefilled(engine: Engine, result: StepResult) -> None:
    """Undo of a prefill whose caller is gone: drop the batch it cached."""
    if result.batch is not None and result.batch.id in engine.store:
        engine.clear(result.batch.id)
