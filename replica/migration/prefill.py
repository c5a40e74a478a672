"""PrefillV2 with MIGRATE / MIGRATE_PROGRESSIVE: prefill here, the KV goes to `pipe_peer`.

```
 engine thread: admit ─ embed ─ layer 0 ─ layer 1 ─ … ─ layer L-1 ─ logits        (one work item)
                  │Admitted     │0        │1              │L-1
 handler thread:  header ─────► send 0 ── send 1 ── … ─── send L-1 ─ ack         (PROGRESSIVE)
                  header ───────────────────────────────────────────► send 0..L-1 ─ ack     (MIGRATE)
 engine thread: first tokens sampled; the batch's pages freed (success) / freed (any failure)
```
The receiver runs Immigrate concurrently, the same call in both cases: the header tells it whether
the KV comes as one run per layer (PROGRESSIVE) or one run for all layers (MIGRATE). The forward
goes layer by layer through the runner's own `run_layers`, the same layer code a normal prefill
runs (on a fully loaded replica only); a layer's KV is handed to the fabric as soon as that layer
returns, while later layers compute. A tensor-parallel replica (`--tp N`) runs whole forwards (its
workers follow whole forwards only) and sends after the forward, per rank, for both cases: the
header says so (not streamed), so the receiver's Immigrate is the same.

Outcome: the response carries the generations (first tokens) and, when a request is still running,
the batch as it would have been cached (`id`, requests, `max_tokens`) — for the router to pair it
with the receiver's Immigrate. The batch is NOT cached on this replica afterwards: its pages are
freed once the send completed (ClearCache of it answers NOT_FOUND). On any failure (prefill or
transfer) the pages are freed too and the call fails with the error's status.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from replica.engine.backend import Runner, SeqInput
from replica.engine.batch import Batch
from replica.engine.engine import Engine
from replica.engine.types import BatchSpec, StepResult
from replica.engine.worker import WorkItem
from replica.errors import AlreadyExists, DeadlineExceeded, PeerTimeout
from replica.migration.manager import Migrations, seq_pages
from replica.migration.plan import Region, chunk_schedule, forward_runs, runs, with_skips
from replica.migration.wire import Runs
from transfer.core import Deadline

T = TypeVar("T")


@dataclass(frozen=True)
class _Failed:
    """The forward failed (its pages are already freed)."""

    error: BaseException


@dataclass(frozen=True)
class _Forwarded:
    """A finished forward: the batch (pages owned by this call), the logits, its timings."""

    batch: Batch
    out: Any  # the runner's forward output
    start_ns: int
    forward_ns: int


_Event = Batch | int | _Failed  # admitted batch, layer done, failure


class MigratingPrefill:
    """Prefill a new batch and move its KV to a peer (after or during the forward)."""

    def __init__(self, migrations: Migrations) -> None:
        self.m = migrations

    def run(
        self,
        spec: BatchSpec,
        peer: int,
        progressive: bool,
        call_remaining: float | None,
        cancelled: threading.Event | None = None,
    ) -> StepResult:
        """The whole PrefillV2 MIGRATE / MIGRATE_PROGRESSIVE call (`cancelled`: the caller is gone,
        the transfer is aborted and the pages freed)."""
        m = self.m
        m.check_group()
        m.check_peer(peer)
        # a tensor-parallel group runs whole forwards only: its KV goes after the forward (per rank)
        progressive = progressive and not _whole_forwards(m.engine.runner)
        deadline = m.deadline(call_remaining)
        events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        item = m.worker.submit(lambda: self._forward(spec, events, progressive))
        try:
            batch = _expect_batch(_next(events, deadline))
            layers = range(m.engine.runner.num_layers)
            chunk = m.engine.limits.prefill_chunk_tokens
            if progressive:
                regions: Runs = lambda skips: self._streamed(events, batch, skips, chunk, deadline)  # noqa: E731
            else:
                regions = lambda skips: self._after(item, batch, skips, deadline)  # noqa: E731
            m.send_batch(batch, peer, layers, deadline, regions, progressive, cancelled, chunk)
            forwarded = _result(item, deadline)
        except BaseException:
            m.later(lambda: self._free_forwarded(item))
            raise
        return _result(m.worker.submit(lambda: self._finish(forwarded)), deadline)

    # ----------------------------------------------------------------------- engine thread
    def _forward(self, spec: BatchSpec, events: queue.SimpleQueue[_Event], progressive: bool) -> _Forwarded:
        engine = self.m.engine
        try:
            engine.readiness.require_complete("a MIGRATE prefill")
            start = time.perf_counter_ns()
            batch = engine.admit(spec)
        except BaseException as exc:
            events.put(_Failed(exc))
            raise
        events.put(batch)
        try:
            out = self._layers(engine, batch, events if progressive else None)
        except BaseException as exc:
            engine.blocks.free(batch.pages())
            events.put(_Failed(exc))
            raise
        return _Forwarded(batch, out, start, time.perf_counter_ns() - start)

    @staticmethod
    def _layers(engine: Engine, batch: Batch, events: queue.SimpleQueue[_Event] | None) -> Any:
        """The runner's forwards (chunks of `--max-batch-prefill-tokens` by `plan.chunk_schedule`,
        then the one that samples), one `run_layers` call per layer, announcing each finished layer."""
        runner, requests = engine.runner, batch.requests
        chunkable = [not r.spec.prefill_logprobs for r in requests]
        budget = engine.limits.prefill_chunk_tokens
        schedule = chunk_schedule([r.prompt_len for r in requests], chunkable, budget)
        whole = _whole_forwards(runner)
        with runner.inference():
            for ends in schedule[:-1]:
                seqs = [SeqInput(r.tokens[r.num_cached : end], r.pages, r.num_cached)
                        for r, end in zip(requests, ends, strict=True) if end > r.num_cached]
                if whole:
                    runner.forward(seqs)
                else:
                    MigratingPrefill._run_layers(runner, seqs, events)
                for r, end in zip(requests, ends, strict=True):
                    r.num_cached = max(r.num_cached, end)
            seqs = Engine.seq_inputs(requests, with_prompt_logprobs=True)
            if whole:
                return runner.forward(seqs)
            hidden, ctx = MigratingPrefill._run_layers(runner, seqs, events)
            return runner.logits(hidden, ctx, seqs)

    @staticmethod
    def _run_layers(
        runner: Runner, seqs: list[SeqInput], events: queue.SimpleQueue[_Event] | None
    ) -> tuple[Any, Any]:
        """One forward through every layer (hidden states and context out), each layer announced."""
        ctx = runner.context(seqs)
        hidden = runner.embed(seqs)
        for layer in range(runner.num_layers):
            hidden = runner.run_layers(hidden, ctx, layer, layer + 1)
            if events is not None:
                events.put(layer)
        return hidden, ctx

    def _finish(self, forwarded: _Forwarded) -> StepResult:
        """Sample the first tokens; the batch's KV has left: free its pages (never cache it here)."""
        engine, batch = self.m.engine, forwarded.batch
        try:
            result = engine.finish_prefill(batch, forwarded.out, forwarded.start_ns, forwarded.forward_ns)
        except AlreadyExists:  # another call cached this id meanwhile: ours was not cached, free it
            engine.blocks.free(batch.pages())
            raise
        if result.batch is not None:  # cached by finish_prefill (some request still runs): drop it
            engine.store.pop(batch.id)
            engine.blocks.free(batch.pages())
        return result

    def _free_forwarded(self, item: WorkItem[_Forwarded]) -> None:
        """(Engine thread, queued after the forward) free the pages of a forward whose send failed.

        A forward that failed freed its own pages; one that never ran allocated nothing.
        """
        future = item.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self.m.engine.blocks.free(future.result().batch.pages())

    # ---------------------------------------------------------------------- handler thread
    def _streamed(
        self, events: queue.SimpleQueue[_Event], batch: Batch, skips: Sequence[int], chunk: int,
        deadline: Deadline,
    ) -> Iterator[Sequence[Region]]:
        """Each forward's layer as soon as it is made: the pages that forward completed."""
        geometry, seqs = self.m.geometry(), with_skips(seq_pages(batch), skips)
        chunkable = [not r.spec.prefill_logprobs for r in batch]
        schedule = chunk_schedule([s.prompt_len for s in seqs], chunkable, chunk)
        for regions in forward_runs(geometry, seqs, range(self.m.engine.runner.num_layers), schedule):
            event = _next(events, deadline)
            if isinstance(event, _Failed):
                raise event.error
            yield regions

    def _after(
        self, item: WorkItem[_Forwarded], batch: Batch, skips: Sequence[int], deadline: Deadline
    ) -> Iterator[Sequence[Region]]:
        _result(item, deadline)  # every layer is in the pages once the forward returned
        layers = range(self.m.engine.runner.num_layers)
        yield from runs(self.m.geometry(), with_skips(seq_pages(batch), skips), layers, streamed=False)


def _whole_forwards(runner: object) -> bool:
    """A tensor-parallel runner broadcasts whole forwards only (not layer by layer)."""
    return int(getattr(runner, "tp_size", 1)) > 1


def _next(events: queue.SimpleQueue[_Event], deadline: Deadline) -> _Event:
    try:
        return events.get(timeout=max(deadline.remaining(), 0.001))
    except queue.Empty:
        raise PeerTimeout("the prefill did not progress before the migration deadline") from None


def _expect_batch(event: _Event) -> Batch:
    if isinstance(event, _Failed):
        raise event.error
    if not isinstance(event, Batch):
        raise TypeError(f"expected the admitted batch first, got {event!r}")
    return event


def _result(item: WorkItem[Any], deadline: Deadline) -> Any:
    """The item's result within the deadline (the item itself still runs if we stop waiting)."""
    try:
        return item.future.result(max(deadline.remaining(), 0.001))
    except FutureTimeout:
        raise DeadlineExceeded("the engine did not finish the prefill within the deadline") from None
