"""`VirtualReplica`: a simulated-GPU replica in virtual time, driven through the router's `ReplicaApi`.

```
 router core (the real one) ── ReplicaApi call ──► VirtualReplica
     engine calls:  lane (one at a time, in arrival order, like the engine thread)
                    ─► the shared Engine over a SimRunner (TallyClock) ─► sleep its modelled time
     KV migration:  both sides meet; the sender's link carries the prompt pages' real bytes
     weights:       VirtualWeights (weights.py)
```
The engine is `replica/engine/engine.py` itself — page accounting, batching, merging, filtering and
every error are the real engine's; only the forward is a modelled time instead of a computation,
and time is the loop's virtual clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from pdcluster.sim import convert
from pdcluster.sim.hardware import Hardware
from pdcluster.sim.lane import EngineLane
from pdcluster.sim.weights import VirtualWeights
from pdcluster.sim.zigzag import VirtualZigzag
from replica.engine.batch import Batch
from replica.engine.engine import Engine
from replica.engine.sim.clock import TallyClock
from replica.engine.sim.runner import SimRunner
from replica.engine.types import BatchSpec as EngineBatch
from replica.engine.types import Reuse
from replica.errors import AlreadyExists, InvalidArgument, ReplicaError
from replica.migration.manager import seq_pages, skipped_pages, take_for_migration
from replica.migration.plan import CacheGeometry, total_bytes, with_skips
from replica.params.store import ParamStore
from router.errors import ReplicaCallError
from router.types import (
    BatchId,
    BatchSpec,
    CachedBatch,
    PeerLink,
    PrefillCase,
    ReplicaInfo,
    RequestId,
    StepResult,
    ZagOutcome,
)
from router.zigzag import RELAYED_CASE

T = TypeVar("T")


class VirtualReplica:
    """One replica (`router.replica_api.ReplicaApi`) on the virtual cluster."""

    def __init__(self, rank: int, engine: Engine, params: ParamStore, clock: TallyClock, hw: Hardware,
                 disk_gbps: float = 0.0, host_gbps: float = 0.0) -> None:
        self.rank = rank
        self.address = f"sim://{rank}"
        self.engine = engine
        self.clock = clock
        self.hw = hw
        self.weights = VirtualWeights(self, params, disk_gbps, host_gbps)
        self.lane = EngineLane(clock, self.error)  # the engine thread: one call at a time, in order
        self.zigzag = VirtualZigzag(self)  # layer-level prefill and split KV (live scaling)
        self._incoming: set[int] = set()  # batch ids being immigrated
        self._calls: dict[str, asyncio.Future[Any]] = {}  # pipelined DecodeV2 calls not yet ended
        runner = engine.runner
        assert isinstance(runner, SimRunner)
        cache = runner.cache
        self.geometry = CacheGeometry(cache.num_blocks, cache.block_size, cache.full_page_bytes)

    # ---- plumbing --------------------------------------------------------------------------------

    async def on_engine(self, method: str, fn: Callable[[], T]) -> T:
        """Run `fn` on the (virtual) engine thread, then let its modelled time pass."""
        return await self.lane.submit(method, fn)

    def error(self, method: str, exc: ReplicaError) -> ReplicaCallError:
        """The router's error for a replica error of this replica."""
        return convert.call_error(self.address, method, exc)

    # ---- facts and steps -------------------------------------------------------------------------

    async def info(self) -> ReplicaInfo:
        """Info: answered at once, beside the engine's queue (as the replica's server does)."""
        return convert.info(self.engine.info(), self.rank, tuple(self.weights.params.host_copies()))

    async def health(self) -> str:
        """Health: "serving" once every weight region is there, else "inactive" (a virtual replica
        never breaks)."""
        return "serving" if (await self.info()).loaded else "inactive"

    async def prefill(self, batch: BatchSpec, case: PrefillCase = PrefillCase.NORMAL,
                      pipe_peer: Sequence[int] = (), resume: int | None = None,
                      chunk_tokens: int = 0) -> StepResult:
        """PrefillV2: NORMAL (a first chunk of it with `chunk_tokens`), or MIGRATE[_PROGRESSIVE] to
        `pipe_peer` (the receiver runs Immigrate)."""
        spec = convert.batch_spec(batch)
        if chunk_tokens and case != PrefillCase.NORMAL:
            raise self.error("PrefillV2", InvalidArgument("chunk_tokens is for a NORMAL prefill only"))
        if case == RELAYED_CASE and resume is not None and resume >= 1:
            return await self.zigzag.resumed_prefill(batch, self._one(pipe_peer, "PrefillV2"), resume)
        if resume is not None or case & (PrefillCase.NAIVE_PP | PrefillCase.IMMIGRATE):
            raise ReplicaCallError(self.address, "PrefillV2", "INVALID_ARGUMENT",
                                   "a layer-level prefill is NAIVE_PP|IMMIGRATE resumed at a layer ≥ 1")
        if case == PrefillCase.NORMAL:
            prefill = lambda: self.engine.prefill(spec, chunk_tokens)  # noqa: E731
            return convert.step(await self.on_engine("PrefillV2", prefill))
        return await self._migrating_prefill(spec, pipe_peer, bool(case & PrefillCase.MIGRATE_PROGRESSIVE))

    async def prefill_chunk(self, batch_id: BatchId, chunk_tokens: int) -> StepResult:
        """PrefillChunk: the next chunk of a prefilling batch."""
        chunk = lambda: self.engine.prefill_chunk(batch_id, chunk_tokens)  # type: ignore[arg-type]  # noqa: E731
        return convert.step(await self.on_engine("PrefillChunk", chunk))

    async def _migrating_prefill(self, spec: EngineBatch, pipe_peer: Sequence[int], progressive: bool
                                 ) -> StepResult:
        """Prefill here; the KV goes to the peer during (progressive) or after the forward; the batch
        is not cached here afterwards."""
        peer = self._one(pipe_peer, "PrefillV2")
        began: list[float] = []  # when the forward took the engine (a queued call waits for the lane)

        def forward() -> tuple[Batch, Any]:
            began.append(self.hw.now())
            return self._prefill_uncached(spec)

        batch, result = await self.on_engine("PrefillV2", forward)
        made = self.hw.now()
        meeting = await self.meet(("kv", self.rank, peer, int(spec.id)), "PrefillV2")
        network, nbytes = self.hw.network, self._kv_bytes(batch, meeting.skips)
        if progressive:  # each layer's KV leaves as soon as the forward has made it
            end = network.send_as_made(self.rank, peer, nbytes, began[0], made, self.engine.runner.num_layers)
        else:
            end = network.send(self.rank, peer, nbytes, made)
        meeting.end.set_result(max(end, self.hw.now()))
        await meeting.ended(self.hw)
        await self.on_engine("PrefillV2", lambda: self.engine.blocks.free(batch.pages()))
        return convert.step(result)

    def _prefill_uncached(self, spec: EngineBatch) -> tuple[Batch, Any]:
        """A prefill whose batch is taken out of the store at once (its pages stay held)."""
        engine = self.engine
        engine.readiness.require_complete("a MIGRATE prefill")
        batch = engine.admit(spec)
        try:
            out = engine.runner.forward(engine.seq_inputs(batch.requests, with_prompt_logprobs=True))
            result = engine.finish_prefill(batch, out, 0, 0)
        except AlreadyExists:
            engine.blocks.free(batch.pages())
            raise
        if result.batch is not None:
            engine.store.pop(batch.id)
        else:  # every request finished: finish_prefill freed the pages
            batch = Batch(batch.id, [])
        return batch, result

    async def zag_prefill(self, batch: BatchSpec, seq: int) -> ZagOutcome:
        """ZagPrefill: layer by layer as the weights land (zigzag.py)."""
        return await self.zigzag.zag_prefill(batch, seq)

    async def relay(self, old_rank: int, relax_not_head: bool) -> tuple[BatchId, int] | None:
        """Relay: one layer-level prefill handed to `old_rank` (zigzag.py)."""
        return await self.zigzag.relay(old_rank, relax_not_head)

    async def migrate_partial(self, batch: BatchSpec, first: bool, split: int, src: Sequence[int],
                              dst: Sequence[int]) -> CachedBatch:
        """MigratePartial: layers [0, split) (first) or [split, L) of a split batch (zigzag.py)."""
        self._split(split, "MigratePartial")
        return await self.zigzag.migrate_partial(batch, first, split, self._one(dst, "MigratePartial"))

    async def immigrate_partial(self, batch: BatchSpec, first: bool, split: int, src: Sequence[int],
                                dst: Sequence[int]) -> CachedBatch:
        """ImmigratePartial: one half in; the second's answer is the decode-ready batch (zigzag.py)."""
        self._split(split, "ImmigratePartial")
        return await self.zigzag.immigrate_partial(batch, first, self._one(src, "ImmigratePartial"))

    def _split(self, split: int, method: str) -> None:
        layers = self.engine.runner.num_layers
        if not 0 < split < layers:
            raise ReplicaCallError(self.address, method, "INVALID_ARGUMENT",
                                   f"num_layer must be in [1, {layers - 1}] (partial), not {split}")

    def start_decode(self, batches: Sequence[CachedBatch], last_tokens: Sequence[Sequence[int]],
                     call_id: str = "", after: str = "") -> Coroutine[Any, Any, StepResult]:
        """DecodeV2. A pipelined call (`after` names the one before it) joins the engine's queue only
        once that one has ended, as the replica's server holds it (`replica/server/rpcs.py`): a
        call that comes meanwhile (an Immigrate, a prefill) waits for one step, not for all sent ahead."""
        inputs = convert.decode_inputs(list(batches), [list(t) for t in last_tokens])
        before = self._calls.get(after) if after else None
        outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if call_id:
            self._calls[call_id] = outcome
            outcome.add_done_callback(lambda _: self._calls.pop(call_id, None))

        def queue(_: object = None) -> None:
            self.lane.submit("DecodeV2", lambda: self.engine.decode(inputs), outcome)

        if before is None or before.done():
            queue()
        else:  # its outcome is its own caller's
            before.add_done_callback(queue)
        return self._decoded(outcome)

    @staticmethod
    async def _decoded(outcome: asyncio.Future[Any]) -> StepResult:
        return convert.step(await outcome)

    async def filter_batch(self, batch_id: BatchId, keep: Sequence[RequestId]) -> CachedBatch:
        """FilterBatch."""
        info = await self.on_engine("FilterBatch", lambda: self.engine.filter(batch_id, keep))  # type: ignore[arg-type]
        return convert.cached(info)

    async def clear_cache(self, batch_id: BatchId | None = None) -> None:
        """ClearCache."""
        await self.on_engine("ClearCache", lambda: self.engine.clear(batch_id))  # type: ignore[arg-type]

    # ---- KV migration ----------------------------------------------------------------------------

    def _one(self, ranks: Sequence[int], method: str) -> int:
        if len(ranks) != 1:
            raise ReplicaCallError(self.address, method, "INVALID_ARGUMENT",
                                   f"one peer expected, got {ranks}")
        return int(ranks[0])

    def _kv_bytes(self, batch: Batch, skips: tuple[int, ...] = ()) -> int:
        """The real bytes of the batch's prompt KV, every layer, less the pages the receiver holds."""
        seqs = with_skips(seq_pages(batch), skips) if skips else seq_pages(batch)
        return total_bytes(self.geometry, seqs, range(self.engine.runner.num_layers))

    async def meet(self, key: tuple[object, ...], method: str, skips: tuple[int, ...] = ()) -> Any:
        try:
            return await self.hw.meet(key, 2, skips)
        except ReplicaError as exc:
            raise self.error(method, exc) from None

    async def migrate(self, batch: BatchSpec, src: Sequence[int], dst: Sequence[int]) -> CachedBatch:
        """Sender: the batch leaves the store, its KV crosses this rank's link, then its pages are freed."""
        peer, spec = self._one(dst, "Migrate"), convert.batch_spec(batch)
        taken = await self.on_engine("Migrate", lambda: take_for_migration(self.engine, spec))
        info = taken.info(self.engine.block_size)
        try:
            meeting = await self.meet(("kv", self.rank, peer, int(spec.id)), "Migrate")
            end = self.hw.network.send(self.rank, peer, self._kv_bytes(taken, meeting.skips), self.hw.now())
            meeting.end.set_result(end)
            await meeting.ended(self.hw)
        finally:
            await self.on_engine("Migrate", lambda: self.engine.blocks.free(taken.pages()))
        return convert.cached(info)

    async def immigrate(self, batch: BatchSpec, src: Sequence[int], dst: Sequence[int]) -> CachedBatch:
        """Receiver: admit the batch (same page counts, the prompt pages its cache holds shared),
        receive the rest of its KV, cache it decode-ready."""
        peer, spec = self._one(src, "Immigrate"), convert.batch_spec(batch)
        admitted = await self.on_engine("Immigrate", lambda: self.admit_incoming(spec))
        skips = skipped_pages(admitted, self.engine.block_size)
        try:
            meeting = await self.meet(("kv", peer, self.rank, int(spec.id)), "Immigrate", skips)
            await meeting.ended(self.hw)
        except BaseException:
            await self.on_engine("Immigrate", lambda: self.drop_incoming(admitted))
            raise
        info = await self.on_engine("Immigrate", lambda: self.adopt(admitted))
        return convert.cached(info, tuple(r.cached_tokens for r in admitted))

    def admit_incoming(self, spec: EngineBatch) -> Batch:
        if spec.id in self._incoming:
            raise AlreadyExists(f"batch {spec.id} is already being immigrated")
        batch = self.engine.admit(spec, Reuse.WHOLE_PROMPT)
        self._incoming.add(spec.id)
        return batch

    def adopt(self, batch: Batch) -> Any:
        self._incoming.discard(batch.id)
        try:
            return self.engine.adopt(batch)
        except BaseException:
            self.engine.blocks.free(batch.pages())
            raise

    def drop_incoming(self, batch: Batch) -> None:
        self._incoming.discard(batch.id)
        self.engine.blocks.free(batch.pages())

    # ---- weights (weights.py) --------------------------------------------------------------------

    async def send_params(self, dst: int, model: str = "", host_copy: bool = False, share: int = 0,
                          shares: int = 0) -> None:
        """SendParams: p2p in the background, of the weight buffer, or (`host_copy`) of the host copy
        of `model` (NOT_FOUND when none is held); `shares`: only share `share` of the regions."""
        self.weights.send(dst, model if host_copy else "", (share, shares))

    async def recv_params(self, src: int, model: str = "", more_srcs: Sequence[int] = ()) -> None:
        """RecvParams: p2p in the background (from `more_srcs` too: a share each); the buffer holds
        `model` from now on ("": its source's)."""
        self.weights.receive(src, model, tuple(more_srcs))

    async def rdma_broadcast(
        self, src_ranks: Sequence[int], dst_ranks: Sequence[int], model: str = ""
    ) -> None:
        """This member's part of a chain multicast, in the background."""
        self.weights.chain(list(src_ranks), list(dst_ranks))

    async def tanz_broadcast(
        self, src_ranks: Sequence[int], dst_ranks: Sequence[int], model: str = ""
    ) -> None:
        """This member's part of a Tanz broadcast (blocking)."""
        await self.weights.tanz(list(src_ranks), list(dst_ranks))

    async def load_params(self, from_host: bool, model: str = "") -> None:
        """LoadParams of `model` from the emulated disk or host memory (blocking)."""
        await self.weights.load(from_host, model)

    async def wait_rdma_done(self) -> None:
        """Join the background weight operation."""
        await self.weights.wait()

    async def reset_status(self) -> None:
        """ResetStatus."""
        self.weights.reset()

    async def connect_peers(self, peers: Sequence[int], timeout: float) -> list[PeerLink]:
        """ConnectPeers: a simulated fabric has no connections to make (its links are modelled)."""
        return [PeerLink(rank, "", 0.0) for rank in peers]

    async def close(self) -> None:
        """Nothing to release."""
