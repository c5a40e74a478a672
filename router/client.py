"""The replica client edge: the only router module that touches `generate_pb2`.

Every call converts the dataclasses of `router/types.py` to protobuf and back, carries a deadline,
and turns a gRPC status into a typed `ReplicaCallError` subclass (`router/errors.py`) so the loops
can decide: a dead replica (`ReplicaUnavailable`) re-queues its requests elsewhere, a replica that
answered that its transfer peer failed (`PeerFailed`) is alive and the batch runs again, anything
else fails only that batch. `ReplicaClient` implements `router.replica_api.ReplicaApi`. With
channel credentials it speaks TLS (`channel_credentials`); with a cluster token every call carries
it as `x-cluster-token` metadata.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from router.errors import (
    PeerFailed,
    ReplicaCallError,
    ReplicaInternal,
    ReplicaRejected,
    ReplicaTimeout,
    ReplicaUnavailable,
    ReplicaUnimplemented,
)
from router.security import TOKEN_KEY, RouterTls
from router.types import (
    BatchId,
    BatchSpec,
    CachedBatch,
    Finished,
    FinishReason,
    Generation,
    GrammarKind,
    PeerLink,
    PrefillCase,
    ReplicaInfo,
    RequestId,
    StepResult,
    TokenInfo,
    TopToken,
    WireRequest,
    ZagOutcome,
)

# gRPC metadata of pipelined DecodeV2 calls (replica/server/ordering.py reads them).
CAUSE_KEY, PEER_CAUSE = "x-pdcluster-cause", "peer"  # replica/errors.py: another replica failed
CALL_KEY = "x-pdcluster-call"
AFTER_KEY = "x-pdcluster-after"
# A replica restarted on its address must be reachable again within about a heartbeat: gRPC's own
# reconnect backoff grows to 2 minutes, during which every call fails UNAVAILABLE at once.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]


_ERRORS: dict[grpc.StatusCode, type[ReplicaCallError]] = {
    grpc.StatusCode.UNAVAILABLE: ReplicaUnavailable,
    grpc.StatusCode.CANCELLED: ReplicaUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: ReplicaTimeout,
    grpc.StatusCode.UNIMPLEMENTED: ReplicaUnimplemented,
    grpc.StatusCode.INVALID_ARGUMENT: ReplicaRejected,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ReplicaRejected,
    grpc.StatusCode.FAILED_PRECONDITION: ReplicaRejected,
    grpc.StatusCode.NOT_FOUND: ReplicaRejected,
    grpc.StatusCode.ALREADY_EXISTS: ReplicaRejected,
    grpc.StatusCode.PERMISSION_DENIED: ReplicaRejected,
    grpc.StatusCode.OUT_OF_RANGE: ReplicaRejected,
    grpc.StatusCode.UNAUTHENTICATED: ReplicaRejected,
}


def channel_credentials(tls: RouterTls) -> grpc.ChannelCredentials | None:
    """TLS towards replicas (verified with `tls.ca`, our certificate as client certificate when we
    have one); None = plaintext (no `tls.ca`)."""
    ca = tls.pem(tls.ca)
    if ca is None:
        return None
    key, chain = tls.key_pair() or (None, None)
    return grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=chain)


def _error(address: str, method: str, exc: grpc.aio.AioRpcError) -> ReplicaCallError:
    code = exc.code()
    cls = _ERRORS.get(code, ReplicaInternal)
    if cls is ReplicaUnavailable and _cause(exc) == PEER_CAUSE:
        cls = PeerFailed
    return cls(address, method, code.name, exc.details() or "")


def _cause(exc: grpc.aio.AioRpcError) -> str | None:
    """The replica's `x-pdcluster-cause` trailing metadata (absent when the replica was not reached)."""
    for key, value in exc.trailing_metadata() or ():
        if key == CAUSE_KEY:
            return str(value)
    return None


# ---- dataclass -> protobuf ----------------------------------------------------------------------


_GRAMMAR_TYPES = {
    GrammarKind.JSON_SCHEMA: pb.GRAMMAR_TYPE_JSON_SCHEMA,
    GrammarKind.JSON_OBJECT: pb.GRAMMAR_TYPE_JSON_OBJECT,
    GrammarKind.REGEX: pb.GRAMMAR_TYPE_REGEX,
}


def _request_pb(wire: WireRequest) -> pb.Request:
    req, s, st = wire.request, wire.request.sampling, wire.request.stopping
    params = pb.NextTokenChooserParameters(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, typical_p=s.typical_p,
        do_sample=s.do_sample, seed=s.seed or 0, repetition_penalty=s.repetition_penalty,
    )
    if s.frequency_penalty:
        params.frequency_penalty = s.frequency_penalty
    if s.presence_penalty:
        params.presence_penalty = s.presence_penalty
    for token, bias in s.logit_bias:
        params.logit_bias[token] = bias
    msg = pb.Request(
        id=wire.id, parameters=params, input_tokens=list(req.input_ids),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=st.max_new_tokens, stop_sequences=list(st.stop_sequences),
            ignore_eos_token=st.ignore_eos, min_new_tokens=st.min_new_tokens,
        ),
        prefill_logprobs=req.prefill_logprobs, top_n_tokens=req.top_n_tokens,
        generated_prefix=req.generated_prefix,
    )
    if req.truncate is not None:
        msg.truncate = req.truncate
    if req.grammar is not None:
        msg.grammar.type = _GRAMMAR_TYPES[req.grammar.kind]
        msg.grammar.text = req.grammar.text
    return msg


def batch_pb(batch: BatchSpec) -> pb.Batch:
    """A new batch as protobuf."""
    return pb.Batch(
        id=batch.id, requests=[_request_pb(r) for r in batch.requests],
        size=len(batch.requests), max_tokens=batch.max_tokens,
    )


def _cached_pb(batch: CachedBatch) -> pb.CachedBatch:
    return pb.CachedBatch(
        id=batch.id, request_ids=list(batch.request_ids), size=len(batch.request_ids),
        max_tokens=batch.max_tokens,
    )


# ---- protobuf -> dataclass ----------------------------------------------------------------------


def _cached(msg: pb.CachedBatch) -> CachedBatch:
    return CachedBatch(BatchId(msg.id), tuple(RequestId(i) for i in msg.request_ids), msg.max_tokens)


def _immigrated(msg: pb.ImmigrateResponse) -> CachedBatch:
    """The decode-ready batch with what the receiver's prefix cache saved (per request) and evicted."""
    batch = msg.batch
    return CachedBatch(BatchId(batch.id), tuple(RequestId(i) for i in batch.request_ids), batch.max_tokens,
                       tuple(msg.request_reused_tokens), tuple(msg.evicted_page_hashes))


def _tokens(msg: pb.Tokens, tops: Sequence[pb.Tokens] = ()) -> tuple[TokenInfo, ...]:
    ids, texts, logprobs, special = msg.ids, msg.texts, msg.logprobs, msg.is_special
    if not tops and len(ids) == len(texts) == len(logprobs) == len(special):
        return tuple(map(TokenInfo, ids, texts, logprobs, special))  # the common case, per decode step
    out = []
    for i, tid in enumerate(msg.ids):
        top: tuple[TopToken, ...] = ()
        if i < len(tops):
            t = tops[i]
            top = tuple(
                TopToken(t.ids[j], _at(t.texts, j, ""), _at(t.logprobs, j, 0.0), _at(t.is_special, j, False))
                for j in range(len(t.ids))
            )
        out.append(TokenInfo(
            tid, _at(msg.texts, i, ""), _at(msg.logprobs, i, 0.0), _at(msg.is_special, i, False), top,
        ))
    return tuple(out)


def _at(seq: Sequence[Any], i: int, default: Any) -> Any:
    return seq[i] if i < len(seq) else default


_REASONS = {
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_EOS_TOKEN: FinishReason.EOS_TOKEN,
    pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
}


def _generation(msg: pb.Generation) -> Generation:
    finished = None
    if msg.HasField("generated_text"):
        g = msg.generated_text
        finished = Finished(
            g.text, g.generated_tokens, _REASONS.get(g.finish_reason, FinishReason.LENGTH),
            g.seed if g.HasField("seed") else None,
        )
    prefill = _tokens(msg.prefill_tokens) if msg.HasField("prefill_tokens") else ()
    return Generation(RequestId(msg.request_id), _tokens(msg.tokens, msg.top_tokens), prefill, finished,
                      msg.cached_tokens)


def _step(generations: Sequence[pb.Generation], batch: pb.CachedBatch | None,
          evicted: Sequence[int] = ()) -> StepResult:
    return StepResult(tuple(_generation(g) for g in generations), _cached(batch) if batch else None,
                      tuple(evicted))


def _set_resume(info: pb.PipeParaInfo, layer: int) -> None:
    """Where a relayed prefill resumes: the embedding (0) or transformer layer `layer`."""
    if layer == 0:
        info.embedding_layer = 1
    else:
        info.tfm_layer = layer
        info.num_layer_per_rank.append(layer)


def _partial(message: Any, batch: BatchSpec, first: bool, split: int, src: Sequence[int],
             dst: Sequence[int]) -> Any:
    half = pb.PARTIAL_CASE_FIRST if first else pb.PARTIAL_CASE_SECOND
    return message(batch=batch_pb(batch), fst_or_snd=half, num_layer=split, src=list(src), dst=list(dst))


def _info(msg: pb.InfoResponse) -> ReplicaInfo:
    return ReplicaInfo(
        model_id=msg.model_id, dtype=msg.dtype, num_layers=msg.num_layers, block_size=msg.block_size,
        num_blocks_total=msg.num_blocks_total, num_blocks_free=msg.num_blocks_free, rank=msg.rank,
        max_input_tokens=msg.max_input_tokens, max_total_tokens=msg.max_total_tokens,
        num_layers_loaded=msg.num_layers_loaded, embed_ready=msg.embed_ready,
        lm_head_ready=msg.lm_head_ready, num_cached_batches=msg.num_cached_batches,
        device_type=msg.device_type, fabric=msg.fabric, prefix_cache=msg.prefix_cache,
        cached_page_hashes=tuple(msg.cached_page_hashes), tp_size=max(1, msg.tp_size),
        weights_model=msg.weights_model,
        host_copies=tuple((c.model, c.bytes) for c in msg.host_copies),
        instance=msg.instance,
    )


@dataclass
class ReplicaClient:
    """An asyncio gRPC client of one replica; every call has a deadline (seconds)."""

    address: str
    timeout: float = 60.0
    transfer_timeout: float = 300.0
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)  # None: plaintext
    token: str = field(default="", repr=False)  # the cluster token ('' = none)
    _channel: grpc.aio.Channel | None = field(default=None, init=False, repr=False)
    _stub: pb_grpc.TextGenerationServiceStub | None = field(default=None, init=False, repr=False)

    @property
    def stub(self) -> pb_grpc.TextGenerationServiceStub:
        """The generated stub on a lazily opened channel (opened inside the running event loop)."""
        if self._stub is None:
            options = [("grpc.max_receive_message_length", 64 << 20), *RECONNECT_OPTIONS]
            if self.credentials is None:
                self._channel = grpc.aio.insecure_channel(self.address, options=options)
            else:
                self._channel = grpc.aio.secure_channel(self.address, self.credentials, options=options)
            # built once per channel: a stub makes a callable for every RPC of the service, and the
            # decode loop calls twice per step
            self._stub = pb_grpc.TextGenerationServiceStub(self._channel)
        return self._stub

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_KEY, self.token),) if self.token else ()

    async def close(self) -> None:
        """Close the channel."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    async def _call(self, method: str, request: object, timeout: float | None = None) -> Any:
        try:
            return await getattr(self.stub, method)(
                request, timeout=timeout or self.timeout, metadata=self._metadata or None
            )
        except grpc.aio.AioRpcError as exc:
            raise _error(self.address, method, exc) from None

    async def info(self) -> ReplicaInfo:
        """Model and cache facts."""
        return _info(await self._call("Info", pb.InfoRequest()))

    async def health(self) -> str:
        """'serving', 'loading' or 'inactive'."""
        resp = await self._call("Health", pb.HealthRequest())
        return str(resp.state)

    async def prefill(
        self, batch: BatchSpec, case: PrefillCase = PrefillCase.NORMAL, pipe_peer: Sequence[int] = (),
        resume: int | None = None, chunk_tokens: int = 0,
    ) -> StepResult:
        """PrefillV2 of a new batch (with migration flags when `case` asks for them); `resume`: a
        relayed batch's layer (NAIVE_PP|IMMIGRATE from `pipe_peer`; 0 = at the embedding);
        `chunk_tokens`: at most that many prompt tokens now (no generations: `prefill_chunk` goes on)."""
        req = pb.PrefillV2Request(batch=batch_pb(batch), forward_case=int(case), pipe_peer=list(pipe_peer),
                                  chunk_tokens=chunk_tokens)
        if resume is not None:
            _set_resume(req.pp_info, resume)
        timeout = self.transfer_timeout if case else None
        resp = await self._call("PrefillV2", req, timeout)
        return _step(resp.generations, resp.batch if resp.HasField("batch") else None,
                     resp.evicted_page_hashes)

    async def prefill_chunk(self, batch_id: BatchId, chunk_tokens: int) -> StepResult:
        """The next chunk of a prefilling batch; its first tokens once every prompt is computed."""
        req = pb.PrefillChunkRequest(batch_id=batch_id, chunk_tokens=chunk_tokens)
        resp = await self._call("PrefillChunk", req)
        return _step(resp.generations, resp.batch if resp.HasField("batch") else None,
                     resp.evicted_page_hashes)

    async def zag_prefill(self, batch: BatchSpec, seq: int) -> ZagOutcome:
        """Layer-by-layer prefill on a replica still receiving weights, admitted in `seq` order."""
        req = pb.ZagPrefillRequest(batch=batch_pb(batch), forward_case=int(PrefillCase.NAIVE_PP),
                                   zag_layers=1, zag_seq_num=seq)
        req.pp_info.embedding_layer = 1
        resp = await self._call("ZagPrefill", req, self.transfer_timeout)
        step = _step(resp.generations, resp.batch if resp.HasField("batch") else None)
        if not resp.HasField("pp_info"):
            return ZagOutcome(step, None)
        where = resp.pp_info.WhichOneof("start_layer")
        return ZagOutcome(step, resp.pp_info.tfm_layer if where == "tfm_layer" else 0)

    async def relay(self, old_rank: int, relax_not_head: bool) -> tuple[BatchId, int] | None:
        """Hand a queued layer-by-layer prefill to `old_rank`: (batch id, seq), or None."""
        resp = await self._call("Relay", pb.RelayRequest(rank=old_rank, relax_not_head=relax_not_head))
        if not resp.HasField("batch_id"):
            return None
        return BatchId(resp.batch_id), int(resp.seq_num)

    async def migrate_partial(self, batch: BatchSpec, first: bool, split: int, src: Sequence[int],
                              dst: Sequence[int]) -> CachedBatch:
        """Sender side of one half of a split KV: layers [0, split) (first) or [split, L)."""
        req = _partial(pb.MigratePartialRequest, batch, first, split, src, dst)
        return _cached((await self._call("MigratePartial", req, self.transfer_timeout)).batch)

    async def immigrate_partial(self, batch: BatchSpec, first: bool, split: int, src: Sequence[int],
                                dst: Sequence[int]) -> CachedBatch:
        """Receiver side of one half; the second half's answer is the decode-ready batch."""
        req = _partial(pb.ImmigratePartialRequest, batch, first, split, src, dst)
        return _immigrated(await self._call("ImmigratePartial", req, self.transfer_timeout))

    async def decode(self, batches: Sequence[CachedBatch], last_tokens: Sequence[Sequence[int]]
                     ) -> StepResult:
        """DecodeV2: append `last_tokens` (one list per batch), merge the batches (id = first), one step."""
        return await self.start_decode(batches, last_tokens)

    def start_decode(self, batches: Sequence[CachedBatch], last_tokens: Sequence[Sequence[int]],
                     call_id: str = "", after: str = "") -> Coroutine[Any, Any, StepResult]:
        """`decode`, with the call started now: it goes out at the caller's next yield to the loop.

        The router's decode loop issues the next steps this way before it streams the previous
        step's tokens, so the replica computes while the router works. `call_id` / `after` (gRPC
        metadata) make the replica queue this call after the call `after` still on the wire.
        """
        req = pb.DecodeV2Request(
            batches=[_cached_pb(b) for b in batches],
            last_iter_tokens=[pb.Tokens(ids=list(ids)) for ids in last_tokens],
        )
        metadata = self._metadata + (((CALL_KEY, call_id),) if call_id else ())
        metadata += ((AFTER_KEY, after),) if after else ()
        # grpc.aio schedules the send at once
        call = self.stub.DecodeV2(req, timeout=self.timeout, metadata=metadata or None)
        return self._decoded(call)

    async def _decoded(self, call: Any) -> StepResult:
        try:
            resp = await call
        except grpc.aio.AioRpcError as exc:
            raise _error(self.address, "DecodeV2", exc) from None
        return _step(resp.generations, resp.batch if resp.HasField("batch") else None,
                     resp.evicted_page_hashes)

    async def filter_batch(self, batch_id: BatchId, keep: Sequence[RequestId]) -> CachedBatch:
        """Keep only `keep`; the replica frees the others' pages."""
        req = pb.FilterBatchRequest(batch_id=batch_id, request_ids=list(keep))
        resp = await self._call("FilterBatch", req)
        return _cached(resp.batch)

    async def clear_cache(self, batch_id: BatchId | None = None) -> None:
        """Free one batch (or every batch when None)."""
        req = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self._call("ClearCache", req)

    async def migrate(self, batch: BatchSpec, src: Sequence[int], dst: Sequence[int]) -> CachedBatch:
        """Sender side of a full KV migration."""
        req = pb.MigrateRequest(batch=batch_pb(batch), src=list(src), dst=list(dst))
        return _cached((await self._call("Migrate", req, self.transfer_timeout)).batch)

    async def immigrate(self, batch: BatchSpec, src: Sequence[int], dst: Sequence[int]) -> CachedBatch:
        """Receiver side of a full KV migration: returns the decode-ready batch."""
        req = pb.ImmigrateRequest(batch=batch_pb(batch), src=list(src), dst=list(dst))
        return _immigrated(await self._call("Immigrate", req, self.transfer_timeout))

    async def send_params(self, dst: int, model: str = "", host_copy: bool = False, share: int = 0,
                          shares: int = 0) -> None:
        """Start a background p2p weight send of `model` to global rank `dst` (`host_copy`: of the
        replica's host-memory copy of `model`, not of its weight buffer; `shares`: only share `share`)."""
        request = pb.SendParamsRequest(dst=dst, host_copy_model=model if host_copy else "",
                                       model_name="" if host_copy else model, share=share, shares=shares)
        await self._call("SendParams", request)

    async def recv_params(self, src: int, model: str = "", more_srcs: Sequence[int] = ()) -> None:
        """Start a background p2p weight receive of `model` from global rank `src` (and `more_srcs`:
        a share of the regions from each)."""
        request = pb.RecvParamsRequest(src=src, model_name=model, more_srcs=list(more_srcs))
        await self._call("RecvParams", request)

    async def rdma_broadcast(
        self, src_ranks: Sequence[int], dst_ranks: Sequence[int], model: str = ""
    ) -> None:
        """Start this member's part of a chain multicast of `model`'s weights."""
        req = pb.BroadcastRequest(src_ranks=list(src_ranks), dst_ranks=list(dst_ranks), model_name=model)
        await self._call("RdmaBroadcast", req)

    async def tanz_broadcast(
        self, src_ranks: Sequence[int], dst_ranks: Sequence[int], model: str = ""
    ) -> None:
        """This member's part of a Tanz broadcast of `model`'s weights (blocks until it is done)."""
        req = pb.BroadcastRequest(src_ranks=list(src_ranks), dst_ranks=list(dst_ranks), model_name=model)
        await self._call("TanzBroadcast", req, self.transfer_timeout)

    async def load_params(self, from_host: bool, model: str = "") -> None:
        """Fill the weights from the model root (`model`: a folder under it) or the host-memory copy
        (of `model`; empty: of the replica's own model)."""
        if from_host:
            req = pb.LoadParamsRequest(load_case=pb.LOAD_FROM_HOST_MEM, model_name=model)
        else:
            req = pb.LoadParamsRequest(load_case=pb.LOAD_FROM_DISK, model_name=model)
        await self._call("LoadParams", req, self.transfer_timeout)

    async def wait_rdma_done(self) -> None:
        """Join the background weight transfer; raises its error."""
        await self._call("WaitRdmaDone", pb.WaitRdmaDoneRequest(), self.transfer_timeout)

    async def reset_status(self) -> None:
        """Mark the weights unloaded."""
        await self._call("ResetStatus", pb.ResetStatusRequest())

    async def connect_peers(self, peers: Sequence[int], timeout: float) -> list[PeerLink]:
        """Set up the replica's fabric connections with the replicas of global ranks `peers`."""
        reply = await self._call("ConnectPeers", pb.ConnectPeersRequest(peers=list(peers)), timeout)
        return [PeerLink(link.rank, link.error, link.connect_ms) for link in reply.links]
