"""`ZigzagManager`: the layer-level prefill queue of a replica still receiving weights.

```
 ZagPrefill(seq) ──wait for seq == next_seq (deadline)──► engine: admit (pages) → task queued
 readiness rises (any thread) ─► poke ─► engine work item "tick": the oldest task that can advance
                                          runs ONE step (embed | layer i | head), then pokes again
 Relay(peer) ─► engine: take the head (or first non-head unfinished) task, send its activation,
                keep its batch cached here (its first k layers' KV), answer its ZagPrefill
```

Everything that touches a task, the model or the pages runs on the engine thread, one step per
work item, so decode steps and migrations interleave with layer-level prefills without locks.
Admission follows `zag_seq_num` order (the router's order); a ZagPrefill whose caller gives up is
removed and its pages freed on the engine thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from replica.engine.engine import Engine
from replica.engine.types import BatchSpec
from replica.engine.worker import EngineWorker
from replica.errors import AlreadyExists, DeadlineExceeded, InvalidArgument, ReplicaError, ShuttingDown
from replica.params.readiness import Readiness
from replica.zigzag.activation import ActivationLink
from replica.zigzag.outcome import OutcomeKind, Relayed, ZagOutcome
from replica.zigzag.task import ZagTask

log = logging.getLogger(__name__)


class ZigzagManager:
    """The ordered task queue and its engine-thread stepping."""

    def __init__(self, engine: Engine, worker: EngineWorker, link: ActivationLink | None) -> None:
        self.engine = engine
        self.worker = worker
        self.link = link  # None without a fabric: relays then cannot send activations
        self.tasks: list[ZagTask] = []  # engine thread only, in seq order
        self._order = threading.Condition()
        self._next_seq = 0
        self._tick_queued = False
        engine.readiness.subscribe(self._on_readiness)

    # ------------------------------------------------------------------ admission (any thread)
    def submit(self, spec: BatchSpec, seq: int, timeout: float | None) -> Future[ZagOutcome]:
        """Admit `spec` once every lower `seq` was admitted; returns the task's future."""
        self._wait_turn(seq, timeout)
        try:
            task = self.worker.call(lambda: self._admit(spec, seq), timeout)
        finally:
            with self._order:
                self._next_seq = seq + 1
                self._order.notify_all()
        self.poke()
        return task.future

    def _wait_turn(self, seq: int, timeout: float | None) -> None:
        with self._order:
            if seq == 0 and not self.tasks:  # (a read of the engine's list: a snapshot is enough)
                self._next_seq = 0  # a new episode: the router numbers from 0 again
            if seq < self._next_seq:
                raise InvalidArgument(f"zag_seq_num {seq} was already admitted (next is {self._next_seq})")
            if not self._order.wait_for(lambda: self._next_seq == seq, timeout):
                raise DeadlineExceeded(f"zag_seq_num {seq}: {self._next_seq} never arrived before it")

    def reset(self) -> None:
        """ResetStatus: the next episode numbers from 0."""
        with self._order:
            self._next_seq = 0
            self._order.notify_all()

    def _admit(self, spec: BatchSpec, seq: int) -> ZagTask:
        if any(t.batch.id == spec.id for t in self.tasks):
            raise AlreadyExists(f"batch {spec.id} is already queued for layer-level prefill")
        task = ZagTask(seq=seq, batch=self.engine.admit(spec), start_ns=time.perf_counter_ns())
        self.tasks.append(task)
        return task

    def wait(self, future: Future[ZagOutcome], timeout: float | None) -> ZagOutcome:
        """Wait for a ZagPrefill's outcome; on timeout the task is dropped (pages freed) on the engine."""
        try:
            return future.result(timeout)
        except FutureTimeout:
            self.worker.submit(lambda: self._abandon(future))
            raise DeadlineExceeded(f"layer-level prefill did not finish within {timeout} s") from None

    def _abandon(self, future: Future[ZagOutcome]) -> None:
        for task in self.tasks:
            if task.future is future:
                self._drop(task, DeadlineExceeded("the caller gave up"))
                return
        if future.done() and future.exception() is None:  # finished or relayed just as the caller left
            info = future.result().batch
            if info is not None and info.id in self.engine.store:
                self.engine.clear(info.id)

    # ------------------------------------------------------------------- stepping (engine)
    def _on_readiness(self, state: Readiness) -> None:
        self.poke()

    def poke(self) -> None:
        """Make sure one tick is queued on the engine thread (safe from any thread)."""
        with self._order:
            if self._tick_queued:
                return
            self._tick_queued = True
        with contextlib.suppress(ShuttingDown):  # stopping: nothing left to advance
            self.worker.submit(self._tick)

    def _tick(self) -> None:
        with self._order:
            self._tick_queued = False
        ready = self.engine.readiness.snapshot()
        task = next((t for t in self.tasks if t.can_advance(ready)), None)  # the oldest first
        if task is None:
            return
        try:
            self._step(task)
        except BaseException as exc:  # the task fails alone; its pages go back first
            log.warning("layer-level prefill of batch %d failed: %s", task.batch.id, exc)
            self._drop(task, exc)
        ready = self.engine.readiness.snapshot()
        if any(t.can_advance(ready) for t in self.tasks):
            self.poke()  # one step per work item: other engine work runs in between

    def _step(self, task: ZagTask) -> None:
        runner = self.engine.runner
        start = time.perf_counter_ns()
        with torch.inference_mode():
            if not task.started:
                task.seqs = self.engine.seq_inputs(task.batch.requests, with_prompt_logprobs=True)
                task.ctx = runner.context(task.seqs)
                task.hidden = runner.embed(task.seqs)
                task.layer = 0
            elif task.layer < runner.num_layers:
                assert task.hidden is not None and task.ctx is not None
                task.hidden = runner.run_layers(task.hidden, task.ctx, task.layer, task.layer + 1)
                task.layer += 1
            else:
                self._finish(task, start)
                return
        task.forward_ns += time.perf_counter_ns() - start

    def _finish(self, task: ZagTask, start: int) -> None:
        assert task.hidden is not None and task.ctx is not None
        out = self.engine.runner.logits(task.hidden, task.ctx, task.seqs)
        self.tasks.remove(task)
        forward_ns = task.forward_ns + time.perf_counter_ns() - start
        result = self.engine.finish_prefill(task.batch, out, task.start_ns, forward_ns)
        task.future.set_result(ZagOutcome(OutcomeKind.FINISHED, result, result.batch, task.layers_done))

    def _drop(self, task: ZagTask, error: BaseException) -> None:
        if task in self.tasks:
            self.tasks.remove(task)
            self.engine.blocks.free(task.batch.pages())
        if not task.future.done():
            task.future.set_exception(error)

    # ------------------------------------------------------------------------- relay (engine)
    def relay(self, peer: int, relax_not_head: bool, timeout: float | None) -> Relayed | None:
        """Hand one task to `peer` (see module docstring); None when nothing can be relayed."""
        return self.worker.call(lambda: self._relay(peer, relax_not_head), timeout)

    def _relay(self, peer: int, relax_not_head: bool) -> Relayed | None:
        task = self._relay_target(relax_not_head)
        if task is None:
            return None
        layers = task.layers_done
        if layers and self.link is None:
            raise ReplicaError("no transfer fabric to send the activation on")
        if layers:
            assert task.hidden is not None
            self.link.send(peer, task.hidden)  # type: ignore[union-attr]
        self.tasks.remove(task)
        for request in task.batch:
            request.num_cached = request.prompt_len  # layers [0, k) of the prompt are in the pages
        self.engine.store.put(task.batch)
        kind = OutcomeKind.RELAYED if layers else OutcomeKind.RELAYED_UNSTARTED
        info = task.batch.info(self.engine.block_size)
        task.future.set_result(ZagOutcome(kind, None, info, layers))
        log.info(
            "relayed batch %d (seq %d) to rank %d after %d layers", task.batch.id, task.seq, peer, layers
        )
        return Relayed(task.batch.id, task.seq)

    def _relay_target(self, relax_not_head: bool) -> ZagTask | None:
        if not self.tasks:
            return None
        if not relax_not_head:
            return self.tasks[0]
        num_layers = self.engine.runner.num_layers
        return next((t for t in self.tasks[1:] if t.layer < num_layers), None)
