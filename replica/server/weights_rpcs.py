"""The weight and layer-level prefill RPCs of a replica (a collaborator `ReplicaServicer` delegates to).

```
 LoadParams ─────────────► ParamOps.run_blocking ─► ParamStore.load_from_disk / load_from_host
 SendParams / RecvParams ─► ParamOps.start_background ─► WeightMover.send_to / recv_from ─┐
 RdmaBroadcast ───────────► ParamOps.start_background ─► WeightMover.chain ───────────────┤ WaitRdmaDone
 NvlBroadcast / TanzBroadcast ─► ParamOps.run_blocking ─► WeightMover.chain / tanz          joins
 ResetStatus / SetStatusReady ─► readiness (refused while an operation holds the guard)
 ZagPrefill / Relay ─► ZigzagManager;  PrefillV2 NAIVE_PP|IMMIGRATE ─► naive_pp_prefill
```

Decisions worth knowing: WaitRdmaDone with no background operation started is FAILED_PRECONDITION
(out of order, not malformed); SetStatusReady without `--allow-set-status-ready` is PERMISSION_DENIED
(an admin backdoor that is switched off); background transfers get `--transfer-timeout`, blocking
ones the smaller of that and the call's deadline.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import grpc
import torch

from protos import generate_pb2 as pb
from replica.cluster import WEIGHT_BUFFER
from replica.engine.engine import Engine
from replica.engine.types import BatchSpec, HealthState
from replica.engine.validation import admit_batch
from replica.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from replica.params.operations import ParamOps
from replica.params.store import ParamStore
from replica.params.transfer import WeightMover, chain_of
from replica.server import convert
from replica.server.shared import ServerState
from replica.zigzag.activation import ActivationLink
from replica.zigzag.manager import ZigzagManager
from replica.zigzag.naive_pp import naive_pp_prefill
from replica.zigzag.task import OutcomeKind, ZagOutcome
from transfer.core import Deadline, Stream

_NO_DEADLINE = 10.0**7  # grpc's "no deadline" shows up as an enormous time_remaining


@dataclass
class WeightState:
    """What the weight RPCs work with, created once the engine and the fabric exist."""

    params: ParamStore
    ops: ParamOps
    zigzag: ZigzagManager
    mover: WeightMover | None  # None without a fabric
    link: ActivationLink | None


def _timeout(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE else max(remaining, 0.0)


class WeightRpcs:
    """LoadParams, Send/RecvParams, WaitRdmaDone, *Broadcast, Reset/SetStatus*, ZagPrefill, Relay."""

    def __init__(self, shared: ServerState) -> None:
        self.shared = shared
        self.state: WeightState | None = None  # set by `attach` once the engine and fabric exist

    def attach(self, engine: Engine, params: ParamStore) -> None:
        """Wire the parameter store, the guard, the movers and the zigzag queue (after the fabric)."""
        cluster, config = self.shared.cluster, self.shared.config
        mover = link = None
        if cluster is not None:
            cluster.fabric.set_layout(Stream.PARAMS, "weights:" + json.dumps(params.layout.signature()))
            mover = WeightMover(cluster.fabric, params, WEIGHT_BUFFER)
            link = ActivationLink(cluster.fabric, config.transfer_timeout)
        zigzag = ZigzagManager(engine, self.shared.worker, link)
        self.state = WeightState(params, ParamOps(), zigzag, mover, link)

    def _state(self) -> WeightState:
        if self.state is None:
            raise FailedPrecondition("the replica is still starting")
        return self.state

    def _mover(self) -> WeightMover:
        mover = self._state().mover
        if mover is None:
            raise FailedPrecondition("no transfer fabric (start the replica with --cluster)")
        return mover

    def _transfer_deadline(self, context: grpc.ServicerContext | None = None) -> Deadline:
        seconds = self.shared.config.transfer_timeout
        call = _timeout(context) if context is not None else None
        return Deadline.after(seconds if call is None else min(seconds, call))

    def health(self) -> HealthState:
        """serving (all loaded), inactive (nothing loaded) or loading (in between)."""
        if self.state is None:
            return HealthState.LOADING
        ready = self.state.params.readiness.snapshot()
        if ready.complete:
            return HealthState.SERVING
        return HealthState.INACTIVE if ready.empty else HealthState.LOADING

    # ------------------------------------------------------------------------------ loading
    def LoadParams(
        self, request: pb.LoadParamsRequest, context: grpc.ServicerContext
    ) -> pb.LoadParamsResponse:
        state = self._state()
        if request.load_case == pb.LOAD_FROM_DISK:
            path = state.params.resolve(request.model_name, request.model_path or None)
            state.ops.run_blocking("LoadParams(disk)", lambda: state.params.load_from_disk(path))
        elif request.load_case == pb.LOAD_FROM_HOST_MEM:
            state.ops.run_blocking("LoadParams(host)", state.params.load_from_host)
        else:
            raise InvalidArgument(f"unknown load_case {request.load_case}")
        return pb.LoadParamsResponse()

    # --------------------------------------------------------------------- p2p and multicast
    def SendParams(
        self, request: pb.SendParamsRequest, context: grpc.ServicerContext
    ) -> pb.SendParamsResponse:
        mover, deadline = self._mover(), self._transfer_deadline()
        self._state().ops.start_background(
            "SendParams",
            lambda: mover.prepare_send(request.dst),
            lambda: mover.send_to(request.dst, deadline),
        )
        return pb.SendParamsResponse()

    def RecvParams(
        self, request: pb.RecvParamsRequest, context: grpc.ServicerContext
    ) -> pb.RecvParamsResponse:
        mover, deadline = self._mover(), self._transfer_deadline()
        self._state().ops.start_background(
            "RecvParams",
            lambda: mover.prepare_recv(request.src),
            lambda: mover.recv_from(request.src, deadline),
        )
        return pb.RecvParamsResponse()

    def RdmaBroadcast(
        self, request: pb.BroadcastRequest, context: grpc.ServicerContext
    ) -> pb.BroadcastResponse:
        mover, deadline = self._mover(), self._transfer_deadline()
        chain = chain_of(list(request.src_ranks), list(request.dst_ranks))
        self._state().ops.start_background(
            "RdmaBroadcast", lambda: mover.prepare_chain(chain), lambda: mover.chain(chain, deadline)
        )
        return pb.BroadcastResponse()

    def NvlBroadcast(
        self, request: pb.BroadcastRequest, context: grpc.ServicerContext
    ) -> pb.BroadcastResponse:
        mover, deadline = self._mover(), self._transfer_deadline(context)
        chain = chain_of(list(request.src_ranks), list(request.dst_ranks))

        def run() -> None:
            mover.prepare_chain(chain)
            mover.chain(chain, deadline)

        self._state().ops.run_blocking("NvlBroadcast", run)
        return pb.BroadcastResponse()

    def TanzBroadcast(
        self, request: pb.BroadcastRequest, context: grpc.ServicerContext
    ) -> pb.BroadcastResponse:
        mover, deadline = self._mover(), self._transfer_deadline(context)
        sources, dests = list(request.src_ranks), list(request.dst_ranks)

        def run() -> None:
            mover.prepare_tanz(sources, dests)
            mover.tanz(sources, dests, deadline)

        self._state().ops.run_blocking("TanzBroadcast", run)
        return pb.BroadcastResponse()

    def WaitRdmaDone(
        self, request: pb.WaitRdmaDoneRequest, context: grpc.ServicerContext
    ) -> pb.WaitRdmaDoneResponse:
        self._state().ops.wait(_timeout(context))
        return pb.WaitRdmaDoneResponse()

    # --------------------------------------------------------------------------- status
    def ResetStatus(
        self, request: pb.ResetStatusRequest, context: grpc.ServicerContext
    ) -> pb.ResetStatusResponse:
        state = self._state()
        state.ops.run_blocking("ResetStatus", state.params.unload)
        state.zigzag.reset()
        return pb.ResetStatusResponse()

    def SetStatusReady(
        self, request: pb.SetStatusReadyRequest, context: grpc.ServicerContext
    ) -> pb.SetStatusReadyResponse:
        if not self.shared.config.allow_set_status_ready:
            raise PermissionDenied(
                "SetStatusReady is disabled (start the replica with --allow-set-status-ready)"
            )
        state = self._state()
        state.ops.run_blocking("SetStatusReady", state.params.readiness.mark_all)
        return pb.SetStatusReadyResponse()

    # ------------------------------------------------------------------ layer-level prefill
    def ZagPrefill(
        self, request: pb.ZagPrefillRequest, context: grpc.ServicerContext
    ) -> pb.PrefillV2Response:
        if not request.forward_case & pb.NAIVE_PP:
            raise InvalidArgument(f"ZagPrefill needs forward_case NAIVE_PP, got {request.forward_case}")
        zigzag = self._state().zigzag
        spec = convert.batch_from_pb(request.batch)
        future = zigzag.submit(spec, request.zag_seq_num, _timeout(context))
        return _zag_response(zigzag.wait(future, _timeout(context)))

    def Relay(self, request: pb.RelayRequest, context: grpc.ServicerContext) -> pb.RelayResponse:
        relayed = self._state().zigzag.relay(request.rank, request.relax_not_head, _timeout(context))
        if relayed is None:
            return pb.RelayResponse()
        return pb.RelayResponse(batch_id=relayed.batch_id, seq_num=relayed.seq)

    def naive_pp_prefill(
        self, request: pb.PrefillV2Request, context: grpc.ServicerContext
    ) -> pb.PrefillV2Response:
        """PrefillV2 NAIVE_PP|IMMIGRATE: finish a relayed batch from layer k (`replica.zigzag.naive_pp`)."""
        if request.forward_case != pb.NAIVE_PP | pb.IMMIGRATE:
            raise InvalidArgument(
                f"PrefillV2 forward_case {request.forward_case}: NAIVE_PP and IMMIGRATE go together (12)"
            )
        engine = self.shared.engine
        if engine is None:
            raise FailedPrecondition("the model is still loading")
        spec = convert.batch_from_pb(request.batch)
        start, hidden = self._incoming_activation(engine, spec, request, context)
        timeout = _timeout(context)
        result = self.shared.worker.call(
            lambda: naive_pp_prefill(engine, spec, start, hidden, timeout), timeout
        )
        response = pb.PrefillV2Response(
            forward_ns=result.forward_ns, decode_ns=result.decode_ns, total_ns=result.total_ns
        )
        convert.fill_step(response, result)
        return response

    def _incoming_activation(
        self, engine: Engine, spec: BatchSpec, request: pb.PrefillV2Request, context: grpc.ServicerContext
    ) -> tuple[int, torch.Tensor | None]:
        """(first layer to run, received activation or None to embed here) from `pp_info`."""
        which = request.pp_info.WhichOneof("start_layer") if request.HasField("pp_info") else None
        num_layers = engine.runner.num_layers
        if which is None or which == "embedding_layer":
            return 0, None
        start = num_layers if which == "lm_head" else request.pp_info.tfm_layer
        if not 0 <= start <= num_layers:
            raise InvalidArgument(f"pp_info.tfm_layer {start} outside 0..{num_layers}")
        if len(request.pipe_peer) != 1:
            raise InvalidArgument(
                f"pipe_peer must name one rank per TP rank (1), got {list(request.pipe_peer)}"
            )
        link = self._state().link
        if link is None:
            raise FailedPrecondition("no transfer fabric to receive the activation on (use --cluster)")
        tokenize = engine.detok.encode if engine.detok.available else None
        tokens = sum(len(p) for p in admit_batch(spec, engine.limits, tokenize))  # the activation's rows
        hidden_size = engine.runner.model.config.hidden_size
        dtype = engine.runner.cache.tensor.dtype
        call = _timeout(context)
        timeout = math.inf if call is None else call  # the link caps it at --transfer-timeout
        return start, link.receive(request.pipe_peer[0], (tokens, hidden_size), dtype, timeout)


def _zag_response(outcome: ZagOutcome) -> pb.PrefillV2Response:
    """Finished: generations and batch, pp_info unset; relayed: the batch kept here and pp_info."""
    if outcome.kind is OutcomeKind.FINISHED:
        result = outcome.result
        assert result is not None
        response = pb.PrefillV2Response(
            forward_ns=result.forward_ns, decode_ns=result.decode_ns, total_ns=result.total_ns
        )
        convert.fill_step(response, result)
        return response
    response = pb.PrefillV2Response()
    if outcome.kind is OutcomeKind.RELAYED:
        response.pp_info.tfm_layer = outcome.layers
        response.pp_info.num_layer_per_rank.append(outcome.layers)
    else:
        response.pp_info.embedding_layer = 1
    if outcome.batch is not None:
        convert.fill_cached_batch(response.batch, outcome.batch)
    return response
