"""Live scaling in virtual time, the replica side: a replica still receiving weights prefills layer by
layer (ZagPrefill) as its regions land, an old replica takes a batch over after k layers (Relay, then
PrefillV2 NAIVE_PP|IMMIGRATE resumed at k), and the split KV goes to one decode replica
(MigratePartial / ImmigratePartial), as `replica/zigzag` does on a GPU.

```
 new replica  ZagPrefill(seq) ─► admit (pages) ─► task; every readiness change pokes one tick
              tick (one engine call): the oldest task that can advance runs ONE step — embed | layer i
              | head — of the SimRunner's modelled time; the head's step answers "finished here"
              Relay (an engine call) ─► the head task (or, relaxed, the first unfinished one after it)
              leaves: kept in the store with layers [0, k) ─► its ZagPrefill answers resume = k
 old replica  PrefillV2(NAIVE_PP|IMMIGRATE, resume k, pipe_peer new): the activation (tokens × hidden
              × itemsize, the card's real bytes) crosses the new replica's link, then
              `replica.zigzag.naive_pp.naive_pp_prefill` (layers [k, L), the head) on its engine
 decode       ImmigratePartial FIRST admits the batch, SECOND waits for it; each half's real bytes
              (its layers of the prompt's pages) cross its sender's link (MigratePartial)
```
The steps are the real runner's `embed` / `run_layers` / `logits` and the engine's `admit` /
`finish_prefill`, so pages, tokens and errors are the engine's; only time is modelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from pdcluster.sim import convert
from pdcluster.sim.hardware import Hardware
from pdcluster.sim.lane import EngineLane
from replica.engine.batch import Batch
from replica.engine.engine import Engine
from replica.engine.types import BatchSpec as EngineBatch
from replica.errors import ReplicaError
from replica.migration.manager import seq_pages, take_for_migration
from replica.migration.plan import CacheGeometry, total_bytes
from replica.model.layout import ITEMSIZE
from replica.params.readiness import Readiness
from replica.zigzag.naive_pp import naive_pp_prefill
from replica.zigzag.task import ZagTask
from router.errors import ReplicaCallError
from router.types import BatchId, BatchSpec, CachedBatch, StepResult, ZagOutcome

T = TypeVar("T")


class Host(Protocol):
    """The parts of a `VirtualReplica` (replica.py) its layer-level calls use."""

    rank: int
    engine: Engine
    hw: Hardware
    lane: EngineLane
    geometry: CacheGeometry

    def error(self, method: str, exc: ReplicaError) -> ReplicaCallError:
        """The router's error for an engine error."""
        ...

    async def on_engine(self, method: str, fn: Callable[[], T]) -> T:
        """`fn` on the engine lane, after its modelled time."""
        ...

    async def meet(self, key: tuple[object, ...], method: str, skips: tuple[int, ...] = ()) -> Any:
        """Both ends of one transfer meet."""
        ...

    def admit_incoming(self, spec: EngineBatch) -> Batch:
        """Admit a batch whose KV comes from another replica."""
        ...

    def adopt(self, batch: Batch) -> Any:
        """Cache an arrived batch decode-ready."""
        ...

    def drop_incoming(self, batch: Batch) -> None:
        """Free a batch that will not arrive."""
        ...


class VirtualZigzag:
    """One virtual replica's layer-level prefills (the new side) and partial KV (both sides)."""

    def __init__(self, replica: Host) -> None:
        self.r = replica
        self.engine = replica.engine
        self.tasks: list[tuple[ZagTask, asyncio.Future[ZagOutcome]]] = []  # in seq order
        self._tick_queued = False
        self._halves: dict[int, asyncio.Future[Batch]] = {}  # a split batch's FIRST half, admitted
        self.engine.readiness.subscribe(self._on_readiness)

    # ---- the new replica -------------------------------------------------------------------------

    async def zag_prefill(self, batch: BatchSpec, seq: int) -> ZagOutcome:
        """Admit the batch, advance it layer by layer as weights land; its outcome (finished here,
        or relayed at `resume`). A cancelled call drops the task and frees its pages."""
        spec = convert.batch_spec(batch)
        outcome: asyncio.Future[ZagOutcome] = asyncio.get_running_loop().create_future()

        def admit() -> None:
            self.tasks.append((ZagTask(seq, self.engine.admit(spec), 0), outcome))

        await self.r.on_engine("ZagPrefill", admit)
        self.poke()
        try:
            return await asyncio.shield(outcome)
        except asyncio.CancelledError:
            self._abandon(outcome)
            raise

    def _abandon(self, outcome: asyncio.Future[ZagOutcome]) -> None:
        """The caller gave up: a task still here leaves (pages freed); a relayed one's batch is cleared."""
        for task, future in list(self.tasks):
            if future is outcome:
                self.tasks.remove((task, future))
                self.engine.blocks.free(task.batch.pages())
        if outcome.done() and not outcome.cancelled() and outcome.result().result.batch is not None:
            batch = outcome.result().result.batch
            assert batch is not None
            if batch.id in self.engine.store:
                self.engine.clear(batch.id)  # type: ignore[arg-type]
        outcome.cancel()

    def _on_readiness(self, _state: Readiness) -> None:
        self.poke()

    def poke(self) -> None:
        """Queue one tick on the engine lane unless one is queued."""
        if self._tick_queued or not self.tasks:
            return
        self._tick_queued = True
        done = self.r.lane.submit("ZagPrefill", self._tick)
        done.add_done_callback(self._ticked)

    def _ticked(self, done: asyncio.Future[Any]) -> None:
        """The step's modelled time has passed: answer a finished task, then the next tick."""
        finished = None if done.cancelled() or done.exception() is not None else done.result()
        if finished is not None:
            outcome, result = finished
            if not outcome.done():
                outcome.set_result(ZagOutcome(convert.step(result), None))
        ready = self.engine.readiness.snapshot()
        if any(t.can_advance(ready) for t, _ in self.tasks):
            self.poke()

    def _tick(self) -> tuple[asyncio.Future[ZagOutcome], Any] | None:
        """One step of the oldest task that can advance (one engine call, as on the engine thread)."""
        self._tick_queued = False
        ready = self.engine.readiness.snapshot()
        pair = next(((t, f) for t, f in self.tasks if t.can_advance(ready)), None)
        if pair is None:
            return None
        task, outcome = pair
        runner = self.engine.runner
        try:
            if not task.started:
                task.seqs = self.engine.seq_inputs(task.batch.requests, with_prompt_logprobs=True)
                task.ctx = runner.context(task.seqs)
                task.hidden, task.layer = runner.embed(task.seqs), 0
            elif task.layer < runner.num_layers:
                task.hidden = runner.run_layers(task.hidden, task.ctx, task.layer, task.layer + 1)
                task.layer += 1
            else:
                out = runner.logits(task.hidden, task.ctx, task.seqs)
                self.tasks.remove(pair)
                return outcome, self.engine.finish_prefill(task.batch, out, 0, 0)
        except Exception as exc:  # the task fails alone; its pages go back first
            self.tasks.remove(pair)
            self.engine.blocks.free(task.batch.pages())
            outcome.set_exception(self.r.error("ZagPrefill", exc) if isinstance(exc, ReplicaError) else exc)
        return None

    async def relay(self, old_rank: int, relax_not_head: bool) -> tuple[BatchId, int] | None:
        """Hand one task to the old replica (an engine call): the head task, or relaxed the first
        unfinished one after it; None when nothing can be relayed."""
        return await self.r.on_engine("Relay", lambda: self._relay(relax_not_head))

    def _relay(self, relax_not_head: bool) -> tuple[BatchId, int] | None:
        layers = self.engine.runner.num_layers
        candidates = self.tasks[1:] if relax_not_head else self.tasks[:1]
        pair = next(((t, f) for t, f in candidates if t.layer < layers), None)
        if pair is None:
            return None
        task, outcome = pair
        self.tasks.remove(pair)
        for request in task.batch:
            request.num_cached = request.prompt_len  # layers [0, k) of the prompt are in its pages
        self.engine.store.put(task.batch)
        kept = convert.cached(task.batch.info(self.engine.block_size))
        outcome.set_result(ZagOutcome(StepResult((), kept), task.layers_done))
        return BatchId(task.batch.id), task.seq

    # ---- the old replica -------------------------------------------------------------------------

    async def resumed_prefill(self, batch: BatchSpec, peer: int, resume: int) -> StepResult:
        """PrefillV2 NAIVE_PP|IMMIGRATE: the activation after `resume` layers comes over the new
        replica's link, then layers [resume, L) and the head run here; the batch is cached here."""
        spec = convert.batch_spec(batch)
        runner, hw = self.engine.runner, self.r.hw
        tokens = sum(len(w.request.input_ids) for w in batch.requests)
        nbytes = tokens * runner.config.hidden_size * ITEMSIZE[self.engine.meta.dtype]
        await hw.sleep_until(hw.network.send(peer, self.r.rank, nbytes, hw.now()))
        hidden = runner.empty_activation(tokens)
        prefill = lambda: naive_pp_prefill(self.engine, spec, resume, hidden, None)  # noqa: E731
        return convert.step(await self.r.on_engine("PrefillV2", prefill))

    # ---- the split KV ----------------------------------------------------------------------------

    def _half_bytes(self, batch: Batch, first: bool, split: int) -> int:
        layers = range(0, split) if first else range(split, self.engine.runner.num_layers)
        return total_bytes(self.r.geometry, seq_pages(batch), layers)

    async def migrate_partial(self, batch: BatchSpec, first: bool, split: int, dst: int) -> CachedBatch:
        """Sender of one half: the batch leaves the store, its layers' KV crosses this rank's link."""
        spec = convert.batch_spec(batch)
        taken = await self.r.on_engine("MigratePartial", lambda: take_for_migration(self.engine, spec))
        info = taken.info(self.engine.block_size)
        try:
            meeting = await self.r.meet(("kv-half", first, self.r.rank, dst, int(spec.id)), "MigratePartial")
            hw = self.r.hw
            meeting.end.set_result(hw.network.send(self.r.rank, dst, self._half_bytes(taken, first, split),
                                                   hw.now()))
            await meeting.ended(hw)
        finally:
            await self.r.on_engine("MigratePartial", lambda: self.engine.blocks.free(taken.pages()))
        return convert.cached(info)

    async def immigrate_partial(self, batch: BatchSpec, first: bool, src: int) -> CachedBatch:
        """Receiver of one half: FIRST admits the batch, SECOND waits for it and adopts it once its
        own half is in (the decode-ready batch)."""
        spec = convert.batch_spec(batch)
        key = int(spec.id)
        if key not in self._halves:
            self._halves[key] = asyncio.get_running_loop().create_future()
        admitted = self._halves[key]
        if first:
            try:
                here = await self.r.on_engine("ImmigratePartial", lambda: self.r.admit_incoming(spec))
                admitted.set_result(here)
            except BaseException as exc:
                self._halves.pop(key, None)
                if not admitted.done():
                    admitted.set_exception(exc if isinstance(exc, Exception) else RuntimeError("cancelled"))
                raise
        try:
            batch_here = await asyncio.shield(admitted)
            meeting = await self.r.meet(("kv-half", first, src, self.r.rank, key), "ImmigratePartial")
            await meeting.ended(self.r.hw)
        except BaseException:
            if admitted.done() and not admitted.exception() and self._halves.pop(key, None) is not None:
                await self.r.on_engine("ImmigratePartial", lambda: self.r.drop_incoming(admitted.result()))
            raise
        if first:
            return convert.cached(batch_here.info(self.engine.block_size))
        self._halves.pop(key, None)
        info = await self.r.on_engine("ImmigratePartial", lambda: self.r.adopt(batch_here))
        return convert.cached(info)
