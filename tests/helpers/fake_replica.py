"""An in-process fake of the replica's gRPC service, for the faults only it can inject.

The router's scenarios run against real replicas (tests/helpers/router_core.py `real_cluster`);
this fake is for what a real one cannot be made to do on cue: a call failing with a chosen code
(`fail`), an UNAVAILABLE that blames the peer (`peer_fail`), migration RPCs that are not
implemented (`migrate = False`), slow steps, transfers and loads (`step_delay`, `immigrate_delay`,
`param_delay`), pages freed late after Migrate (`free_after_migrate`), a sender that waits for its
receiver to take the batch (`migrate_waits`, as a real one waits for the receiver's answer), and
counters of what ran
at once. It answers like a real replica otherwise — batches and pages (`fake_batches.py`), weights
(`fake_weights.py`) — which tests/component/router/test_fake_replica_conformance.py checks by
running one script against both. Replicas started with the same `FakeFabric` migrate KV between
each other by Migrate ‖ Immigrate (or PrefillV2 MIGRATE_PROGRESSIVE ‖ Immigrate).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from grpc.aio import ServicerContext as Context

from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from tests.helpers.fake_batches import NUM_LAYERS, FakeBatches, FakeRequest
from tests.helpers.fake_batches import expected_tokens as expected_tokens
from tests.helpers.fake_errors import Refused
from tests.helpers.fake_weights import FakeWeights

MIGRATION_RPCS = ("Migrate", "Immigrate", "SendParams", "RecvParams", "RdmaBroadcast")


@dataclass
class FakeFabric:
    """Shared by fake replicas of one test: batches in flight by (src rank, dst rank, batch id)."""

    sent: dict[tuple[int, int, int], asyncio.Future[list[FakeRequest]]] = field(default_factory=dict)
    taken: dict[tuple[int, int, int], asyncio.Future[None]] = field(default_factory=dict)

    def slot(self, src: int, dst: int, batch_id: int) -> asyncio.Future[list[FakeRequest]]:
        """The rendezvous of one migration."""
        key = (src, dst, batch_id)
        if key not in self.sent:
            self.sent[key] = asyncio.get_running_loop().create_future()
        return self.sent[key]

    def taken_by_receiver(self, src: int, dst: int, batch_id: int) -> asyncio.Future[None]:
        """Set when the receiver of one migration took its batch."""
        return self.taken.setdefault((src, dst, batch_id), asyncio.get_running_loop().create_future())


def rpc(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Record the call, inject what the test asked for, map a `Refused` to its status."""
    @functools.wraps(method)
    async def handler(self: FakeReplica, request: Any, context: Context) -> Any:
        await self.enter(method.__name__, context)
        try:
            return await method(self, request, context)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
    return handler


def sent_copy(reqs: list[FakeRequest]) -> list[FakeRequest]:
    """What a migration moves: the prompt's KV; the first token arrives with the next DecodeV2."""
    return [FakeRequest(r.id, r.tokens[:-1], r.max_new, r.pages, ignore_eos=r.ignore_eos) for r in reqs]


class FakeReplica(pb_grpc.TextGenerationServiceServicer):
    """The fake servicer; `calls` records method names in order."""

    def __init__(self, rank: int, fabric: FakeFabric, num_blocks: int = 256, block_size: int = 16,
                 eos: int | None = None, loaded: bool = True, migrate: bool = True, tp: int = 1) -> None:
        self.rank, self.fabric = rank, fabric
        self.tp = tp  # a tensor-parallel group of global ranks rank .. rank + tp - 1
        self.rank_lists: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []  # (call, src, dst) of moves
        # a tensor-parallel group that lost a rank: rank 0 still answers Info and ClearCache (they run
        # no collective), every other call (Health too) fails UNAVAILABLE, for good
        self.broken = False
        self.state = FakeBatches(num_blocks, block_size, eos)
        self.weights = FakeWeights(loaded)
        self.calls: list[str] = []
        self.fail: dict[str, grpc.StatusCode] = {}  # calls that fail once with that code
        self.peer_fail: set[str] = set()  # calls that fail once UNAVAILABLE, blaming the peer
        self.migrate = migrate  # False: migration and weight RPCs answer UNIMPLEMENTED
        self.fabric_kind = "tcp"  # what Info reports as this replica's fabric
        self.model_name = "fake"  # the model Info names
        self.instance = f"fake-{rank}"  # Info's process id (a test "restarting" it sets another)
        self.connected: list[int] = []  # ranks ConnectPeers asked for, in order
        self.step_delay = 0.0
        # the next Info calls block the whole process this long each (time.sleep): in-process the
        # router shares the fakes' event loop, so its polls in flight stall, as in a long GC pause
        self.info_stalls: list[float] = []
        self.immigrate_delay = 0.0
        # A replica frees a migrated batch's pages on its engine thread after answering Migrate; a
        # call sent after that answer can overtake the free there. Seconds the fake lags by.
        self.free_after_migrate = 0.0
        # Migrate answers only once the receiver took the batch (up to 30 s; a cancel keeps it here)
        self.migrate_waits = False
        self.refused_pages = 0  # PrefillV2 calls refused for want of pages
        self.immigrating = self.max_immigrating = 0
        self.prefilling = self.max_prefilling = 0  # PrefillV2 calls being served now, and the most at once
        self.cancelled: list[str] = []  # calls whose caller cancelled them while they waited
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._engine = asyncio.Lock()  # one step at a time, like the replica's engine thread
        self._order: dict[str, asyncio.Event] = {}  # pipelined DecodeV2 calls seen (by call id)

    # -------------------------------------------------------------- what tests look at
    @property
    def num_blocks(self) -> int:
        """Pages in all."""
        return self.state.num_blocks

    @property
    def free(self) -> int:
        """Pages free now."""
        return self.state.free

    @property
    def batches(self) -> dict[int, list[FakeRequest]]:
        """Cached batches by id."""
        return self.state.batches

    @property
    def loaded(self) -> bool:
        """Every weight region is in place."""
        return self.weights.loaded

    @loaded.setter
    def loaded(self, value: bool) -> None:
        self.weights.loaded = value

    async def pages(self) -> tuple[int, int]:
        """(total, free) KV pages."""
        return self.state.num_blocks, self.state.free

    @property
    def param_op(self) -> str:
        """The parameter operation holding the guard ("" = none)."""
        return self.weights.op

    @property
    def param_delay(self) -> float:
        """Seconds a weight transfer or load takes."""
        return self.weights.delay

    @param_delay.setter
    def param_delay(self, value: float) -> None:
        self.weights.delay = value

    # ---------------------------------------------------------------- serving
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

    async def enter(self, name: str, context: Context) -> None:
        """Record a call; fail it if the test said so."""
        self.calls.append(name)
        if self.broken and name not in ("Info", "ClearCache"):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{name}: the tensor-parallel group lost a rank")
        if name in self.fail:
            await context.abort(self.fail.pop(name), f"injected failure of {name}")
        if name in self.peer_fail:
            self.peer_fail.discard(name)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV migration: injected peer failure of {name}",
                                trailing_metadata=(("x-pdcluster-cause", "peer"),))
        if name in MIGRATION_RPCS and not self.migrate:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented here")

    def _require_weights(self, what: str) -> None:
        if not self.loaded:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{what} needs every weight region")

    # ------------------------------------------------------------------------- facts
    @rpc
    async def Info(self, request: pb.InfoRequest, context: Context) -> pb.InfoResponse:
        if self.info_stalls:
            time.sleep(self.info_stalls.pop(0))
        s, ready = self.state, self.loaded
        return pb.InfoResponse(
            dtype="float32", device_type="cpu", model_id=self.model_name, num_layers=NUM_LAYERS,
            block_size=s.block_size,
            num_blocks_total=s.num_blocks, num_blocks_free=s.free, embed_ready=ready,
            num_layers_loaded=NUM_LAYERS if ready else 0, lm_head_ready=ready, rank=self.rank,
            tp_size=self.tp,
            num_cached_batches=len(s.batches), max_input_tokens=s.max_input_tokens,
            max_total_tokens=s.max_total_tokens, fabric=self.fabric_kind, instance=self.instance,
        )

    @rpc
    async def Health(self, request: pb.HealthRequest, context: Context) -> pb.HealthResponse:
        return pb.HealthResponse(state="serving" if self.loaded else "inactive")

    # ----------------------------------------------------------------------- batches
    @rpc
    async def PrefillV2(self, request: pb.PrefillV2Request, context: Context) -> pb.PrefillV2Response:
        if request.forward_case and not self.migrate:
            raise Refused(grpc.StatusCode.UNIMPLEMENTED, "migrating prefills are not implemented here")
        self._require_weights("a prefill")
        try:
            reqs = self.state.admit(request.batch)
        except Refused as exc:
            self.refused_pages += exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            raise
        self.prefilling += 1
        self.max_prefilling = max(self.max_prefilling, self.prefilling)
        try:
            await asyncio.sleep(self.step_delay)
        finally:
            self.prefilling -= 1
        gens = [self.state.advance(r) for r in reqs]
        cached = self.state.keep(request.batch.id, reqs)
        if request.forward_case & (pb.MIGRATE | pb.MIGRATE_PROGRESSIVE):
            # as on a replica: a migrating prefill's batch goes to the peer and is not kept here
            self.fabric.slot(self.rank, request.pipe_peer[0], request.batch.id).set_result(sent_copy(reqs))
            try:
                await self._receiver_took(request.pipe_peer[0], request.batch.id, "PrefillV2")
            finally:
                if cached is not None:
                    self.state.give_back(self.state.batches.pop(request.batch.id))
        return pb.PrefillV2Response(generations=gens, batch=cached)

    @rpc
    async def DecodeV2(self, request: pb.DecodeV2Request, context: Context) -> pb.DecodeV2Response:
        # Like the replica: steps run one at a time, a pipelined call after the one it names.
        meta = dict(context.invocation_metadata() or ())
        if "x-pdcluster-after" in meta:
            await asyncio.wait_for(self._submitted(str(meta["x-pdcluster-after"])).wait(), 5.0)
        async with self._engine:
            if "x-pdcluster-call" in meta:
                self._submitted(str(meta["x-pdcluster-call"])).set()
            self._require_weights("decode")
            bid, merged, gens = self.state.merge(request.batches, request.last_iter_tokens)
            await asyncio.sleep(self.step_delay)
            gens += [self.state.advance(r) for r in merged if not r.done]
            return pb.DecodeV2Response(generations=gens, batch=self.state.keep(bid, merged))

    def _submitted(self, call: str) -> asyncio.Event:
        return self._order.setdefault(call, asyncio.Event())

    @rpc
    async def FilterBatch(self, request: pb.FilterBatchRequest, context: Context) -> pb.FilterBatchResponse:
        return pb.FilterBatchResponse(batch=self.state.filter(request.batch_id, list(request.request_ids)))

    @rpc
    async def ClearCache(self, request: pb.ClearCacheRequest, context: Context) -> pb.ClearCacheResponse:
        self.state.clear(request.id if request.HasField("id") else None)
        return pb.ClearCacheResponse()

    # --------------------------------------------------------------------- migration
    @rpc
    async def Migrate(self, request: pb.MigrateRequest, context: Context) -> pb.MigrateResponse:
        self._per_rank("Migrate", request.src, request.dst)
        reqs = self.state.get(request.batch.id)
        self.fabric.slot(self.rank, request.dst[0], request.batch.id).set_result(sent_copy(reqs))
        cached = self.state.cached(request.batch.id)
        gone = self.state.batches.pop(request.batch.id)  # a replica's Migrate frees it, even cancelled
        try:
            await self._receiver_took(request.dst[0], request.batch.id, "Migrate")
        finally:
            if self.free_after_migrate:
                asyncio.get_running_loop().call_later(self.free_after_migrate, self.state.give_back, gone)
            else:
                self.state.give_back(gone)
        return pb.MigrateResponse(batch=cached)

    async def _receiver_took(self, dst: int, batch_id: int, call: str) -> None:
        """(`migrate_waits`) Wait until the receiver took the batch, as a sender waits for its answer."""
        if not self.migrate_waits:
            return
        try:
            taken = self.fabric.taken_by_receiver(self.rank, dst, batch_id)
            await asyncio.wait_for(asyncio.shield(taken), 30)
        except asyncio.CancelledError:
            self.cancelled.append(call)
            raise

    @rpc
    async def Immigrate(self, request: pb.ImmigrateRequest, context: Context) -> pb.ImmigrateResponse:
        self._per_rank("Immigrate", request.src, request.dst)
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
        if not (taken := self.fabric.taken_by_receiver(*key)).done():
            taken.set_result(None)
        need = sum(r.pages for r in got)
        if need > self.state.free:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"need {need} KV pages, {self.state.free} free")
        self.state.free -= need
        return pb.ImmigrateResponse(batch=self.state.keep(request.batch.id, got))

    # ----------------------------------------------------------------------- weights
    @rpc
    async def SendParams(self, request: pb.SendParamsRequest, context: Context) -> pb.SendParamsResponse:
        self.weights.start_background("SendParams", receives=False, sends=True)
        return pb.SendParamsResponse()

    @rpc
    async def RecvParams(self, request: pb.RecvParamsRequest, context: Context) -> pb.RecvParamsResponse:
        self.weights.start_background("RecvParams", receives=True, sends=False)
        return pb.RecvParamsResponse()

    @rpc
    async def RdmaBroadcast(self, request: pb.BroadcastRequest, context: Context) -> pb.BroadcastResponse:
        receives = self._member(request, tanz=False)
        self.weights.start_background("RdmaBroadcast", receives=receives, sends=not receives)
        return pb.BroadcastResponse()

    @rpc
    async def TanzBroadcast(self, request: pb.BroadcastRequest, context: Context) -> pb.BroadcastResponse:
        receives = self._member(request, tanz=True)
        await self.weights.run_blocking("TanzBroadcast", receives=receives, sends=not receives)
        return pb.BroadcastResponse()

    def _per_rank(self, call: str, src: Sequence[int], dst: Sequence[int]) -> None:
        """A KV move names one rank per tp_rank on each side (the seeds' contract), as a real group checks."""
        self.rank_lists.append((call, tuple(src), tuple(dst)))
        if len(src) != self.tp or len(dst) != self.tp:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{call}: src {list(src)} and dst {list(dst)} need one rank per tp_rank "
                          f"({self.tp})")

    def _member(self, request: pb.BroadcastRequest, tanz: bool) -> bool:
        """Whether this replica receives in a valid broadcast (INVALID_ARGUMENT for an invalid one):
        every rank of every group named, groups contiguous (this group's ranks in a row)."""
        sources, dests = list(request.src_ranks), list(request.dst_ranks)
        self.rank_lists.append(("TanzBroadcast" if tanz else "RdmaBroadcast", tuple(sources), tuple(dests)))
        members = sources + dests
        uneven = tanz and bool(sources) and len(dests) % len(sources) != 0
        twice = len(set(members)) != len(members)
        group = list(range(self.rank, self.rank + self.tp))
        start = members.index(self.rank) if self.rank in members else -1
        split = len(sources) % self.tp or len(dests) % self.tp or members[start:start + self.tp] != group
        if not sources or not dests or uneven or twice or self.rank not in members or split:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"not a valid broadcast for rank {self.rank}: "
                                                            f"{sources} -> {dests}")
        return self.rank in dests

    @rpc
    async def WaitRdmaDone(self, request: pb.WaitRdmaDoneRequest, context: Context
                           ) -> pb.WaitRdmaDoneResponse:
        await self.weights.join()
        return pb.WaitRdmaDoneResponse()

    @rpc
    async def LoadParams(self, request: pb.LoadParamsRequest, context: Context) -> pb.LoadParamsResponse:
        if request.load_case == pb.LOAD_FROM_HOST_MEM:
            await self.weights.load_from_host()
        else:
            await self.weights.load_from_disk(request.model_path or request.model_name)
        return pb.LoadParamsResponse()

    @rpc
    async def ConnectPeers(self, request: pb.ConnectPeersRequest, context: Context
                           ) -> pb.ConnectPeersResponse:
        self.connected.extend(request.peers)
        return pb.ConnectPeersResponse(links=[pb.PeerLink(rank=p, connect_ms=0.1) for p in request.peers])

    @rpc
    async def ResetStatus(self, request: pb.ResetStatusRequest, context: Context) -> pb.ResetStatusResponse:
        await self.weights.reset()
        return pb.ResetStatusResponse()
