"""The gRPC edge of a replica: one table from each RPC to its call (`messages.py`) and back.

```
 gRPC thread ─► handler(route) ─► route.to_call(request) ─► Call
                  [DecodeV2: wait for the call it follows, ordering.py]
                  client.start(call, deadline) ─► LocalCore (in process) | RemoteCore (front process)
                  client.wait ─► reply ─► route.to_pb(reply) ─► response
                  errors: interceptor.guard (ReplicaError → its status, + x-pdcluster-cause)
```
The table and the handlers are the same in both placements: `--no-grpc-frontend` only changes
the client they call. A SERVICE call is watched with a grpc callback: the RPC ending unanswered
cancels it in the core (its waits and senders stop). A call with an `orphan` whose caller left
(deadline or cancel) has its result undone when it arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from protos import generate_pb2 as pb
from replica.engine.types import BatchId, CachedBatchInfo, ImmigratedBatch, RequestId, StepResult
from replica.errors import InvalidArgument
from replica.server import convert
from replica.server import messages as m
from replica.server.client import CoreClient, Pending
from replica.server.interceptor import guard
from replica.server.ordering import CallOrder, call_names
from replica.zigzag.outcome import OutcomeKind, Relayed, ZagOutcome

SERVICE = pb.DESCRIPTOR.services_by_name["TextGenerationService"].full_name
ENGINE_KEY = "x-pdcluster-engine"
"""Initial metadata of every response of a replica that is not the torch engine (`simulated; gpu=…`)."""
_NO_DEADLINE = 10.0**7  # seconds; grpc's "no deadline" shows up as an enormous time_remaining


@dataclass(frozen=True)
class Rpc:
    """One RPC: its request type, the call it makes, and the response built from the reply."""

    request: type[Message]
    to_call: Callable[[Any], m.Call]
    to_pb: Callable[[Any], Message]
    ordered: bool = False  # honours x-pdcluster-call / x-pdcluster-after (pipelined DecodeV2)


# ------------------------------------------------------------------------------------ requests
def _prefill_v2(request: pb.PrefillV2Request) -> m.Call:
    """PrefillV2 by its forward_case: NORMAL, MIGRATE[_PROGRESSIVE] or NAIVE_PP|IMMIGRATE."""
    case, batch = request.forward_case, convert.batch_from_pb(request.batch)
    peers = tuple(request.pipe_peer)
    if request.chunk_tokens and case != m.PrefillCase.NORMAL:
        raise InvalidArgument(f"chunk_tokens is for a NORMAL prefill only, not forward_case {case}")
    if case & (m.PrefillCase.NAIVE_PP | m.PrefillCase.IMMIGRATE):  # only NAIVE_PP|IMMIGRATE is valid
        which = request.pp_info.WhichOneof("start_layer") if request.HasField("pp_info") else None
        start = None if which is None else m.PipeStart(which)
        return m.PipelinedPrefill(batch, case, start, request.pp_info.tfm_layer, peers)
    if case & (m.PrefillCase.MIGRATE | m.PrefillCase.MIGRATE_PROGRESSIVE):
        return m.MigratingPrefill(batch, case, peers)
    if case != m.PrefillCase.NORMAL:
        raise InvalidArgument(f"PrefillV2 forward_case {case}: not a valid PrefillCase")
    return m.Prefill(batch, request.chunk_tokens)


def _migration(kind: type[m.Migrate] | type[m.Immigrate]) -> Callable[[Any], m.Call]:
    def to_call(request: Any) -> m.Call:
        return kind(convert.batch_from_pb(request.batch), tuple(request.src), tuple(request.dst))

    return to_call


def _partial(kind: type[m.MigratePartial] | type[m.ImmigratePartial]) -> Callable[[Any], m.Call]:
    def to_call(request: Any) -> m.Call:
        batch = convert.batch_from_pb(request.batch)
        return kind(batch, request.fst_or_snd, request.num_layer, tuple(request.src), tuple(request.dst))

    return to_call


def _broadcast(kind: m.BroadcastKind) -> Callable[[pb.BroadcastRequest], m.Call]:
    return lambda r: m.Broadcast(kind, tuple(r.src_ranks), tuple(r.dst_ranks), r.model_name)


# ----------------------------------------------------------------------------------- responses
def _prefilled(response: pb.PrefillResponse | pb.PrefillV2Response, result: StepResult) -> Message:
    response.forward_ns, response.decode_ns, response.total_ns = (
        result.forward_ns,
        result.decode_ns,
        result.total_ns,
    )
    convert.fill_step(response, result)
    return response


def _decoded_v1(result: StepResult) -> pb.DecodeResponse:
    response = pb.DecodeResponse(
        forward_ns=result.forward_ns,
        decode_ns=result.decode_ns,
        total_ns=result.total_ns,
        concat_ns=result.concat_ns,
    )
    convert.fill_step(response, result)
    return response


def _decoded(result: StepResult) -> pb.DecodeV2Response:
    response = pb.DecodeV2Response(total_ns=result.total_ns)
    convert.fill_step(response, result)
    return response


def _zag(outcome: ZagOutcome) -> pb.PrefillV2Response:
    """Finished: generations and batch, pp_info unset; relayed: the batch kept here and pp_info."""
    if outcome.kind is OutcomeKind.FINISHED:
        assert outcome.result is not None
        return _prefilled(pb.PrefillV2Response(), outcome.result)
    response = pb.PrefillV2Response()
    if outcome.kind is OutcomeKind.RELAYED:
        response.pp_info.tfm_layer = outcome.layers
        response.pp_info.num_layer_per_rank.append(outcome.layers)
    else:
        response.pp_info.embedding_layer = 1
    if outcome.batch is not None:
        convert.fill_cached_batch(response.batch, outcome.batch)
    return response


def _relayed(relayed: Relayed | None) -> pb.RelayResponse:
    if relayed is None:
        return pb.RelayResponse()
    return pb.RelayResponse(batch_id=relayed.batch_id, seq_num=relayed.seq)


def _batch(response: type[Any]) -> Callable[[CachedBatchInfo], Message]:
    return lambda info: response(batch=convert.cached_batch_to_pb(info))


def _immigrated(done: ImmigratedBatch) -> pb.ImmigrateResponse:
    return pb.ImmigrateResponse(
        batch=convert.cached_batch_to_pb(done.info),
        reused_tokens=sum(done.reused_tokens),
        request_reused_tokens=list(done.reused_tokens),
        evicted_page_hashes=list(done.evicted_page_hashes),
    )


def _empty(response: type[Message]) -> Callable[[Any], Message]:
    return lambda _: response()


RPCS: dict[str, Rpc] = {
    "Info": Rpc(
        pb.InfoRequest, lambda r: m.Info(),
        lambda i: convert.info_to_pb(i.engine, i.rank, i.tp_size, i.fabric, i.weights_model, i.host_copies,
                                     i.instance),
    ),
    "ConnectPeers": Rpc(
        pb.ConnectPeersRequest,
        lambda r: m.ConnectPeers(tuple(r.peers)),
        lambda links: pb.ConnectPeersResponse(links=[
            pb.PeerLink(rank=link.rank, error=link.error, connect_ms=link.connect_ms) for link in links
        ]),
    ),
    "ServiceDiscovery": Rpc(
        pb.ServiceDiscoveryRequest,
        lambda r: m.Discover(),
        lambda d: pb.ServiceDiscoveryResponse(urls=d.urls, ranks_view_in_json=d.ranks_json),
    ),
    "ClearCache": Rpc(
        pb.ClearCacheRequest,
        lambda r: m.Clear(BatchId(r.id) if r.HasField("id") else None),
        _empty(pb.ClearCacheResponse),
    ),
    "FilterBatch": Rpc(
        pb.FilterBatchRequest,
        lambda r: m.Filter(BatchId(r.batch_id), tuple(RequestId(i) for i in r.request_ids)),
        _batch(pb.FilterBatchResponse),
    ),
    "Warmup": Rpc(
        pb.WarmupRequest,
        lambda r: m.Warmup(convert.warmup_from_pb(r)),
        lambda tokens: pb.WarmupResponse(max_supported_total_tokens=tokens),
    ),
    "Prefill": Rpc(
        pb.PrefillRequest,
        lambda r: m.Prefill(convert.batch_from_pb(r.batch)),
        lambda result: _prefilled(pb.PrefillResponse(), result),
    ),
    "Decode": Rpc(
        pb.DecodeRequest, lambda r: m.Decode(convert.decode_inputs_from_pb(r.batches)), _decoded_v1
    ),
    "Health": Rpc(pb.HealthRequest, lambda r: m.Health(), lambda state: pb.HealthResponse(state=state.value)),
    "SendParams": Rpc(pb.SendParamsRequest,
                      lambda r: m.SendParams(r.dst, r.model_name, r.host_copy_model, r.share, r.shares),
                      _empty(pb.SendParamsResponse)),
    "RecvParams": Rpc(pb.RecvParamsRequest, lambda r: m.RecvParams(r.src, r.model_name, tuple(r.more_srcs)),
                      _empty(pb.RecvParamsResponse)),
    "LoadParams": Rpc(
        pb.LoadParamsRequest,
        lambda r: m.LoadParams(r.load_case, r.model_name, r.model_path or None),
        _empty(pb.LoadParamsResponse),
    ),
    "PrefillV2": Rpc(
        pb.PrefillV2Request, _prefill_v2, lambda result: _prefilled(pb.PrefillV2Response(), result)
    ),
    "PrefillChunk": Rpc(
        pb.PrefillChunkRequest,
        lambda r: m.PrefillChunk(BatchId(r.batch_id), r.chunk_tokens),
        lambda result: _prefilled(pb.PrefillV2Response(), result),
    ),
    "DecodeV2": Rpc(
        pb.DecodeV2Request,
        lambda r: m.Decode(convert.decode_inputs_from_pb(r.batches, r.last_iter_tokens)),
        _decoded,
        ordered=True,
    ),
    "ZagPrefill": Rpc(
        pb.ZagPrefillRequest,
        lambda r: m.ZagPrefill(convert.batch_from_pb(r.batch), r.forward_case, r.zag_seq_num),
        _zag,
    ),
    "Migrate": Rpc(pb.MigrateRequest, _migration(m.Migrate), _batch(pb.MigrateResponse)),
    "Immigrate": Rpc(pb.ImmigrateRequest, _migration(m.Immigrate), _immigrated),
    "MigratePartial": Rpc(pb.MigratePartialRequest, _partial(m.MigratePartial), _batch(pb.MigrateResponse)),
    "ImmigratePartial": Rpc(
        pb.ImmigratePartialRequest, _partial(m.ImmigratePartial), _immigrated
    ),
    "WaitRdmaDone": Rpc(pb.WaitRdmaDoneRequest, lambda r: m.WaitRdmaDone(), _empty(pb.WaitRdmaDoneResponse)),
    "ResetStatus": Rpc(pb.ResetStatusRequest, lambda r: m.ResetStatus(), _empty(pb.ResetStatusResponse)),
    "SetStatusReady": Rpc(
        pb.SetStatusReadyRequest, lambda r: m.SetStatusReady(), _empty(pb.SetStatusReadyResponse)
    ),
    "Relay": Rpc(pb.RelayRequest, lambda r: m.Relay(r.rank, r.relax_not_head), _relayed),
    "NvlBroadcast": Rpc(pb.BroadcastRequest, _broadcast(m.BroadcastKind.NVL), _empty(pb.BroadcastResponse)),
    "RdmaBroadcast": Rpc(pb.BroadcastRequest, _broadcast(m.BroadcastKind.RDMA), _empty(pb.BroadcastResponse)),
    "TanzBroadcast": Rpc(pb.BroadcastRequest, _broadcast(m.BroadcastKind.TANZ), _empty(pb.BroadcastResponse)),
}


# ------------------------------------------------------------------------------------ handlers
# A SERVICE call learns at once that its caller is gone (a grpc callback cancels its context: its
# waits and senders stop). An ENGINE call always ends soon, so it is not watched (a callback per
# call costs the hot path); one with an `orphan` has its result undone if its caller left meanwhile.
_CANCELLABLE: dict[type[m.Call], bool] = {kind: kind.lane is m.Lane.SERVICE for kind in m.CALLS}
_UNDOABLE: dict[type[m.Call], bool] = {kind: kind.orphan is not m.Call.orphan for kind in m.CALLS}


def _deadline(context: grpc.ServicerContext) -> float | None:
    """The call's deadline as a time.monotonic() value; None when the caller set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE:
        return None
    return time.monotonic() + max(remaining, 0.0)


class Edge:
    """The gRPC handlers of the service, over one `CoreClient`."""

    def __init__(self, client: CoreClient, engine_tag: str = "") -> None:
        self.client = client
        self.order = CallOrder()  # pipelined DecodeV2 calls reach the core in the caller's order
        self.metadata = ((ENGINE_KEY, engine_tag),) if engine_tag else None

    def handler(self, rpc: Rpc) -> Callable[[Any, grpc.ServicerContext], Message]:
        """The handler of one RPC (errors mapped by `guard`)."""

        def handle(request: Any, context: grpc.ServicerContext) -> Message:
            if self.metadata is not None:
                context.send_initial_metadata(self.metadata)
            deadline = _deadline(context)
            call, pending = self._start(rpc, request, deadline, context)
            kind = type(call)
            if _CANCELLABLE[kind] and not context.add_callback(lambda: self.client.ended(pending)):
                self.client.give_up(pending)  # the RPC has ended already (the caller cancelled)
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            reply = self.client.wait(pending, timeout)
            if _UNDOABLE[kind] and not context.is_active():  # the caller left while it ran
                self.client.discard(call, reply)
            return rpc.to_pb(reply)

        return guard(handle)

    def _start(
        self, rpc: Rpc, request: Any, deadline: float | None, context: grpc.ServicerContext
    ) -> tuple[m.Call, Pending]:
        if not rpc.ordered:
            call = rpc.to_call(request)
            return call, self.client.start(call, deadline)
        # A pipelined call (the router keeps several on the wire) is started after the one it
        # follows; the engine's queue (or the socket and its single reader) keeps that order.
        name, after = call_names(context.invocation_metadata())
        if after is not None:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            self.order.follow(after, remaining)
        try:
            call = rpc.to_call(request)
            return call, self.client.start(call, deadline)
        finally:
            if name is not None:
                self.order.submitted(name)  # also when it failed: its successor must not wait

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Every RPC of the service, for `grpc.Server.add_generic_rpc_handlers`."""
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self.handler(rpc),
                request_deserializer=rpc.request.FromString,
                response_serializer=_serialize,
            )
            for name, rpc in RPCS.items()
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _serialize(response: Message) -> bytes:
    return response.SerializeToString()
