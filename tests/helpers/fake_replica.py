"""A small in-process fake of the replica's gRPC service, for router tests that need fault injection
or exact call sequences (real replicas are used everywhere else).

The "model" is deterministic: the next token is `(previous * 7 + 3) % vocab` (`eos` ends a request
unless ignored). Pages follow the replica's rule (prompt + max_new_tokens reserved at admission) so
`num_blocks_free` is exact. Replicas started with the same `FakeFabric` migrate KV between each
other by Migrate ‖ Immigrate (or PrefillV2 MIGRATE_PROGRESSIVE ‖ Immigrate).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
import grpc.aio

from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc

VOCAB = 97


def next_token(prev: int) -> int:
    """The fake model."""
    return (prev * 7 + 3) % VOCAB


def expected_tokens(prompt: Iterable[int], n: int) -> list[int]:
    """What the fake model generates greedily after `prompt` (no EOS)."""
    out, last = [], list(prompt)[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


@dataclass
class FakeRequest:
    """One request's state on a fake replica."""

    id: int
    tokens: list[int]
    max_new: int
    pages: int
    generated: int = 0
    done: bool = False


@dataclass
class FakeFabric:
    """Shared by fake replicas of one test: batches in flight by (src rank, dst rank, batch id)."""

    sent: dict[tuple[int, int, int], asyncio.Future[list[FakeRequest]]] = field(default_factory=dict)

    def slot(self, src: int, dst: int, batch_id: int) -> asyncio.Future[list[FakeRequest]]:
        """The rendezvous of one migration."""
        key = (src, dst, batch_id)
        if key not in self.sent:
            self.sent[key] = asyncio.get_running_loop().create_future()
        return self.sent[key]


class FakeReplica(pb_grpc.TextGenerationServiceServicer):
    """The fake servicer; `calls` records method names in order."""

    def __init__(self, rank: int, fabric: FakeFabric, num_blocks: int = 256, block_size: int = 16,
                 eos: int | None = None, loaded: bool = True, migrate: bool = True) -> None:
        self.rank, self.fabric, self.block_size, self.eos = rank, fabric, block_size, eos
        self.num_blocks = num_blocks
        self.free = num_blocks
        self.batches: dict[int, list[FakeRequest]] = {}
        self.calls: list[str] = []
        self.fail: dict[str, grpc.StatusCode] = {}
        self.peer_fail: set[str] = set()  # calls that fail once UNAVAILABLE, blaming the peer
        self.loaded = loaded
        self.migrate = migrate
        self.step_delay = 0.0
        self.immigrate_delay = 0.0
        # A replica frees a migrated batch's pages on its engine thread after answering Migrate; a
        # call sent after that answer can overtake the free there. Seconds the fake lags by.
        self.free_after_migrate = 0.0
        self.refused_pages = 0  # PrefillV2 calls refused for want of pages
        self.immigrating = 0
        self.max_immigrating = 0
        self.cancelled: list[str] = []  # calls whose caller cancelled them while they waited
        self.param_op = ""  # the parameter operation in the background (one at a time, as on a replica)
        self.param_delay = 0.0  # seconds a weight transfer takes (blocking ones, or until WaitRdmaDone)
        self.host_copy = True  # LoadParams from host memory finds a copy
        self.prefilling = 0  # PrefillV2 calls being served now, and the most at once
        self.max_prefilling = 0
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._engine = asyncio.Lock()  # one step at a time, like the replica's engine thread
        self._order: dict[str, asyncio.Event] = {}  # pipelined DecodeV2 calls seen (by call id)

    async def start(self, port: int = 0) -> str:
        """Serve on 127.0.0.1 (`port`, or a free one); returns the address."""
        self.server = grpc.aio.server()
        pb_grpc.add_TextGenerationServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        """Stop serving (in-flight calls are cancelled: clients see UNAVAILABLE/CANCELLED)."""
        if self.server is not None:
            await self.server.stop(None)

    async def _enter(self, name: str, context: grpc.aio.ServicerContext) -> None:
        self.calls.append(name)
        if name in self.fail:
            await context.abort(self.fail.pop(name), f"injected failure of {name}")
        if name in self.peer_fail:
            self.peer_fail.discard(name)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV migration: injected peer failure of {name}",
                                trailing_metadata=(("x-pdcluster-cause", "peer"),))
        if name in ("Migrate", "Immigrate", "SendParams", "RecvParams", "RdmaBroadcast") and not self.migrate:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} lands with issue 4")

    # ---- facts ----

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        await self._enter("Info", context)
        return pb.InfoResponse(
            dtype="float32", device_type="cpu", model_id="fake", num_layers=2, block_size=self.block_size,
            num_blocks_total=self.num_blocks, num_blocks_free=self.free, embed_ready=self.loaded,
            num_layers_loaded=2 if self.loaded else 0, lm_head_ready=self.loaded, rank=self.rank, tp_size=1,
            num_cached_batches=len(self.batches), max_input_tokens=512, max_total_tokens=1024,
        )

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        await self._enter("Health", context)
        return pb.HealthResponse(state="serving" if self.loaded else "inactive")

    # ---- batches ----

    def _admit(self, batch: pb.Batch, context_tokens: bool = True) -> list[FakeRequest]:
        reqs = []
        for r in batch.requests:
            tokens = list(r.input_tokens)
            pages = -(-(len(tokens) + r.stopping_parameters.max_new_tokens) // self.block_size)
            reqs.append(FakeRequest(r.id, tokens, r.stopping_parameters.max_new_tokens, pages))
        need = sum(q.pages for q in reqs)
        if need > self.free:
            raise ValueError("no pages")
        self.free -= need
        return reqs

    def _advance(self, req: FakeRequest) -> pb.Generation:
        tok = next_token(req.tokens[-1])
        req.tokens.append(tok)
        req.generated += 1
        tokens = pb.Tokens(ids=[tok], logprobs=[-0.5], texts=[f"<{tok}>"], is_special=[False])
        gen = pb.Generation(request_id=req.id, tokens=tokens)
        if req.generated >= req.max_new or tok == self.eos:
            req.done = True
            reason = pb.FINISH_REASON_LENGTH if req.generated >= req.max_new else pb.FINISH_REASON_EOS_TOKEN
            start = len(req.tokens) - req.generated
            text = "".join(f"<{t}>" for t in req.tokens[start:])
            gen.generated_text.CopyFrom(pb.GeneratedText(text=text, generated_tokens=req.generated,
                                                         finish_reason=reason))
        return gen

    def _cached(self, batch_id: int) -> pb.CachedBatch | None:
        reqs = self.batches.get(batch_id)
        if reqs is None:
            return None
        if all(r.done for r in reqs):
            self._free(batch_id)
            return None
        return pb.CachedBatch(id=batch_id, request_ids=[r.id for r in reqs], size=len(reqs),
                              max_tokens=sum(r.pages for r in reqs) * self.block_size)

    def _free(self, batch_id: int) -> None:
        self._give_back(self.batches.pop(batch_id, []))

    def _give_back(self, reqs: list[FakeRequest]) -> None:
        for r in reqs:
            self.free += r.pages

    async def PrefillV2(self, request: pb.PrefillV2Request, context: grpc.aio.ServicerContext
                        ) -> pb.PrefillV2Response:
        await self._enter("PrefillV2", context)
        if request.forward_case and not self.migrate:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "MIGRATE cases land with issue 4")
        if request.batch.id in self.batches:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "batch exists")
        try:
            reqs = self._admit(request.batch)
        except ValueError:
            self.refused_pages += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "not enough pages")
        self.prefilling += 1
        self.max_prefilling = max(self.max_prefilling, self.prefilling)
        try:
            await asyncio.sleep(self.step_delay)
        finally:
            self.prefilling -= 1
        gens = [self._advance(r) for r in reqs]
        self.batches[request.batch.id] = reqs
        cached = self._cached(request.batch.id)
        if request.forward_case & 3:
            # The KV goes as it was before the first token was sampled (the receiver gets it as last tokens).
            sent = [FakeRequest(r.id, r.tokens[:-1], r.max_new, r.pages) for r in reqs]
            self.fabric.slot(self.rank, request.pipe_peer[0], request.batch.id).set_result(sent)
            self._free(request.batch.id)  # as on a replica: a migrating prefill's batch is not kept here
        return pb.PrefillV2Response(generations=gens, batch=cached)

    async def DecodeV2(self, request: pb.DecodeV2Request, context: grpc.aio.ServicerContext
                       ) -> pb.DecodeV2Response:
        await self._enter("DecodeV2", context)
        # Like the replica: steps run one at a time, a pipelined call after the one it names.
        meta = dict(context.invocation_metadata() or ())
        if "x-pdcluster-after" in meta:
            await asyncio.wait_for(self._submitted(str(meta["x-pdcluster-after"])).wait(), 5.0)
        async with self._engine:
            if "x-pdcluster-call" in meta:
                self._submitted(str(meta["x-pdcluster-call"])).set()
            return await self._decode(request, context)

    def _submitted(self, call: str) -> asyncio.Event:
        return self._order.setdefault(call, asyncio.Event())

    async def _decode(self, request: pb.DecodeV2Request, context: grpc.aio.ServicerContext
                      ) -> pb.DecodeV2Response:
        ids = [b.id for b in request.batches]
        if any(i not in self.batches for i in ids):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown batch in {ids}")
        merged: list[FakeRequest] = []
        for b, last in zip(request.batches, request.last_iter_tokens, strict=True):
            reqs = self.batches.pop(b.id)
            for r, tok in zip(reqs, last.ids, strict=False):
                r.tokens.append(tok)
                r.generated += 1
            merged += reqs
        self.batches[ids[0]] = merged
        await asyncio.sleep(self.step_delay)
        gens = [self._advance(r) for r in merged if not r.done]
        return pb.DecodeV2Response(generations=gens, batch=self._cached(ids[0]))

    async def FilterBatch(self, request: pb.FilterBatchRequest, context: grpc.aio.ServicerContext
                          ) -> pb.FilterBatchResponse:
        await self._enter("FilterBatch", context)
        if request.batch_id not in self.batches:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown batch")
        reqs = self.batches[request.batch_id]
        keep = set(request.request_ids)
        for r in reqs:
            if r.id not in keep:
                self.free += r.pages
        self.batches[request.batch_id] = [r for r in reqs if r.id in keep]
        cached = self._cached(request.batch_id)
        return pb.FilterBatchResponse(batch=cached)

    async def ClearCache(self, request: pb.ClearCacheRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ClearCacheResponse:
        await self._enter("ClearCache", context)
        if request.HasField("id"):
            if request.id not in self.batches:
                await context.abort(grpc.StatusCode.NOT_FOUND, "unknown batch")
            self._free(request.id)
        else:
            for batch_id in list(self.batches):
                self._free(batch_id)
        return pb.ClearCacheResponse()

    # ---- migration ----

    async def Migrate(self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
                      ) -> pb.MigrateResponse:
        await self._enter("Migrate", context)
        if request.batch.id not in self.batches:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown batch")
        reqs = self.batches[request.batch.id]
        sent = [FakeRequest(r.id, r.tokens[:-1], r.max_new, r.pages) for r in reqs]
        self.fabric.slot(self.rank, request.dst[0], request.batch.id).set_result(sent)
        cached = self._cached(request.batch.id)
        gone = self.batches.pop(request.batch.id, [])
        if self.free_after_migrate:
            asyncio.get_running_loop().call_later(self.free_after_migrate, self._give_back, gone)
        else:
            self._give_back(gone)
        return pb.MigrateResponse(batch=cached)

    async def Immigrate(self, request: pb.ImmigrateRequest, context: grpc.aio.ServicerContext
                        ) -> pb.ImmigrateResponse:
        await self._enter("Immigrate", context)
        key = (request.src[0], self.rank, request.batch.id)
        self.immigrating += 1
        self.max_immigrating = max(self.max_immigrating, self.immigrating)
        try:
            got = await asyncio.wait_for(self.fabric.slot(*key), 10)
            await asyncio.sleep(self.immigrate_delay)
        except asyncio.CancelledError:
            self.cancelled.append("Immigrate")
            raise
        finally:
            self.immigrating -= 1
        del self.fabric.sent[key]
        need = sum(r.pages for r in got)
        if need > self.free:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "not enough pages")
        self.free -= need
        self.batches[request.batch.id] = got
        return pb.ImmigrateResponse(batch=self._cached(request.batch.id))

    # ---- weights ----

    async def SendParams(self, request: pb.SendParamsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.SendParamsResponse:
        await self._enter("SendParams", context)
        await self._start_param_op("SendParams", context)
        return pb.SendParamsResponse()

    async def RecvParams(self, request: pb.RecvParamsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.RecvParamsResponse:
        await self._enter("RecvParams", context)
        await self._start_param_op("RecvParams", context)
        self.loaded = True
        return pb.RecvParamsResponse()

    async def RdmaBroadcast(self, request: pb.BroadcastRequest, context: grpc.aio.ServicerContext
                            ) -> pb.BroadcastResponse:
        await self._enter("RdmaBroadcast", context)
        await self._start_param_op("RdmaBroadcast", context)
        if self.rank in request.dst_ranks:
            self.loaded = True
        return pb.BroadcastResponse()

    async def WaitRdmaDone(self, request: pb.WaitRdmaDoneRequest, context: grpc.aio.ServicerContext
                           ) -> pb.WaitRdmaDoneResponse:
        await self._enter("WaitRdmaDone", context)
        if self.param_op:
            await asyncio.sleep(self.param_delay)  # the background transfer's time
        self.param_op = ""  # joined: the next operation may start
        return pb.WaitRdmaDoneResponse()

    async def _start_param_op(self, name: str, context: grpc.aio.ServicerContext) -> None:
        if self.param_op:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{name}: another parameter operation ({self.param_op}) is in flight")
        self.param_op = name

    async def TanzBroadcast(self, request: pb.BroadcastRequest, context: grpc.aio.ServicerContext
                            ) -> pb.BroadcastResponse:
        await self._enter("TanzBroadcast", context)
        await self._start_param_op("TanzBroadcast", context)
        try:
            await asyncio.sleep(self.param_delay)
        finally:
            self.param_op = ""  # blocking: nothing left in the background
        if self.rank in request.dst_ranks:
            self.loaded = True
        return pb.BroadcastResponse()

    async def LoadParams(self, request: pb.LoadParamsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.LoadParamsResponse:
        await self._enter("LoadParams", context)
        if request.load_case == pb.LOAD_FROM_HOST_MEM and not self.host_copy:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no host-memory copy")
        await self._start_param_op("LoadParams", context)
        try:
            await asyncio.sleep(self.param_delay)
        finally:
            self.param_op = ""
        self.loaded = True
        return pb.LoadParamsResponse()

    async def ResetStatus(self, request: pb.ResetStatusRequest, context: grpc.aio.ServicerContext
                          ) -> pb.ResetStatusResponse:
        await self._enter("ResetStatus", context)
        self.loaded = False
        return pb.ResetStatusResponse()
