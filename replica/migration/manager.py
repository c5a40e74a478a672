"""`Migrations`: the sender and receiver sides of a KV migration on one replica.

```
 Migrate(batch, dst)                                Immigrate(batch, src)
   engine: take the batch out of the store            engine: admit (validate, allocate the same page counts)
   gate to dst ─ send header + layers ═══════════►    turn from src ─ header ─ receive layers
   engine: free its pages (success or failure)        engine: adopt → decode-ready CachedBatch
                                                      (failure: free what was allocated)
```
Only the engine thread allocates, frees and touches the batch store (work items through
`EngineWorker`); transfers run on the fabric's threads and the call's own thread waits for
them with a deadline: the smaller of `--transfer-timeout` and the call's own deadline.

The sender's batch leaves the store when its migration starts (so no decode, filter or clear can
touch pages in flight); its pages are freed only once the send completed or failed. A batch id
being immigrated counts as present: a second Immigrate of it is ALREADY_EXISTS.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from replica.cancellation import aborting
from replica.cluster import ReplicaCluster
from replica.engine.batch import Batch
from replica.engine.engine import Engine
from replica.engine.types import BatchId, BatchSpec, CachedBatchInfo, ImmigratedBatch, Reuse
from replica.engine.worker import EngineWorker
from replica.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from replica.migration import wire
from replica.migration.gates import InboundTurns, SendGates
from replica.migration.plan import (
    CacheGeometry,
    Header,
    LayerHalf,
    Region,
    SeqPages,
    chunk_schedule,
    forward_runs,
    layer_range,
    runs,
    total_bytes,
    with_skips,
)
from replica.tp.kvmove import ShardMover, settled, with_shards
from transfer.core import Deadline
from transfer.errors import TransferError
from transfer.plans import OpKind

T = TypeVar("T")
Defer = Callable[[Callable[[], None]], None]
"""Schedules work for after the call's answer went out (logging is not on the caller's clock)."""


def _now(fn: Callable[[], None]) -> None:
    """The `Defer` of a caller without an answer to wait for: run at once."""
    fn()


log = logging.getLogger(__name__)

_CALL_SHARE = 0.95  # of the gRPC deadline given to the transfer: the answer must still reach the caller


@dataclass(frozen=True)
class Route:
    """One migration's peers (global ranks) and layers, from the request's src/dst lists."""

    peer: int
    half: LayerHalf = LayerHalf.ALL
    split: int = 0


class Migrations:
    """Migrate / Immigrate (full and partial) for one replica; thread-safe."""

    def __init__(self, engine: Engine, worker: EngineWorker, cluster: ReplicaCluster, timeout: float) -> None:
        self.engine = engine
        self.worker = worker
        self.cluster = cluster
        self.timeout = timeout
        self.gates = SendGates()
        self.turns = InboundTurns(park_seconds=timeout)
        self.incoming: set[BatchId] = set()  # batch ids being immigrated (engine thread only)

    # --------------------------------------------------------------------------- plumbing
    def deadline(self, call_remaining: float | None) -> Deadline:
        """The transfer deadline: `--transfer-timeout`, cut to (most of) the call's deadline."""
        seconds = self.timeout
        if call_remaining is not None:
            seconds = min(seconds, call_remaining * _CALL_SHARE)
        return Deadline.after(seconds)

    def on_engine(
        self, fn: Callable[[], T], deadline: Deadline, undo: Callable[[T], None] | None = None
    ) -> T:
        """Run `fn` on the engine thread within the deadline (`undo` cleans up if it finished too late)."""
        return self.worker.call(fn, max(deadline.remaining(), 0.001), undo)

    def later(self, fn: Callable[[], object]) -> None:
        """Queue `fn` on the engine thread, not waiting (cleanup that happens whatever the caller does)."""
        self.worker.submit(fn)

    def geometry(self) -> CacheGeometry:
        """Where pages live in the (current) KV buffer; re-registers it if Warmup replaced it."""
        cache = self.engine.runner.cache
        self.cluster.ensure_kv(cache.tensor)
        return CacheGeometry(cache.num_blocks, cache.block_size, cache.bytes_per_page())

    def check_peer(self, peer: int) -> int:
        """A usable peer rank: in the table and not this replica."""
        if peer == self.cluster.rank or peer not in self.cluster.table:
            raise InvalidArgument(f"rank {peer} is not a peer in the rank table (this: {self.cluster.rank})")
        return peer

    def check_group(self) -> None:
        """Under --tp N: FailedPrecondition unless every rank has a fabric endpoint. (A peer of
        another tp size fails the KV stream's handshake: the layouts differ, `wire.as_replica_error`.)"""
        self.mover()

    # ----------------------------------------------------------------------------- sender
    def migrate(
        self,
        spec: BatchSpec,
        route: Route,
        call_remaining: float | None,
        after_reply: Defer = _now,
        cancelled: threading.Event | None = None,
    ) -> CachedBatchInfo:
        """Send the cached batch's KV of `route`'s layers to the peer; the batch is gone here afterwards.

        `after_reply` schedules the log line (the caller runs it once the answer went out). Once
        `cancelled` is set the transfer is aborted and the pages freed (nobody takes the answer).
        """
        self.check_group()
        self.check_peer(route.peer)
        layers = layer_range(route.half, route.split, self.engine.runner.num_layers)
        deadline = self.deadline(call_remaining)
        start = time.perf_counter()
        batch = self.on_engine(lambda: self._take(spec), deadline, undo=self._free)
        info = batch.info(self.engine.block_size)
        taken = time.perf_counter()
        try:
            regions = self._all_layers(batch, layers)
            self.send_batch(batch, route.peer, layers, deadline, regions, False, cancelled)
        finally:
            self.later(lambda: self._free(batch))
        after_reply(_rate_line("sent", batch, self.geometry(), layers, start, taken))
        return info

    def send_batch(
        self,
        batch: Batch,
        peer: int,
        layers: range,
        deadline: Deadline,
        regions: wire.Runs,
        streamed: bool,
        cancelled: threading.Event | None = None,
        chunk_tokens: int = 0,
    ) -> tuple[int, ...]:
        """Serialised with other migrations to `peer`: header, the receiver's have, the runs of
        regions, the receiver's ack; returns the pages per request the receiver held already.

        `regions(skips)` yields one run per layer when `streamed`, else a single run over all layers,
        leaving each request's first `skips[i]` pages out (streamed by a chunked prefill: one run per
        forward and layer, `plan.forward_runs` with `chunk_tokens`). A caller giving up (`cancelled`)
        aborts the pair's KV streams: every wait below fails at once.
        """
        geometry = self.geometry()
        seqs = seq_pages(batch)
        nbytes = total_bytes(geometry, seqs, layers)
        nonce = secrets.randbits(63)
        header = Header(int(batch.id), nonce, layers, nbytes, streamed, len(seqs), chunk_tokens)
        mover, jobs = self.mover(streamed), []
        if mover is not None:  # the workers move their shards once the have fixed the pages
            regions = with_shards(regions, lambda r: jobs.append(
                mover.start(OpKind.SEND, peer, r, nonce, deadline)))
        release = self.gates.acquire(peer, deadline.remaining(), cancelled)
        fabric = self.cluster.fabric
        try:
            with aborting(cancelled, lambda: wire.abort_sender(fabric, peer, "the caller cancelled")):
                skips = settled(mover, jobs, deadline, lambda: wire.send_kv(fabric, peer, header, regions,
                                                                             deadline))
            return skips
        except TransferError as exc:
            raise wire.as_replica_error(exc) from exc
        finally:
            release()

    def mover(self, streamed: bool = False) -> ShardMover | None:
        """Rank 0's `ShardMover` of a tensor-parallel replica (None at tp 1). FailedPrecondition when
        its ranks have no fabric endpoints, or for streamed runs (layer-by-layer forwards are not
        broadcast to the workers)."""
        runner = self.engine.runner
        tp = getattr(runner, "tp_size", 1)
        if tp == 1:
            return None
        mover: ShardMover | None = getattr(runner, "shard_mover", None)
        if mover is None:
            raise FailedPrecondition(
                f"KV migration of a tensor-parallel replica (--tp {tp}) needs every rank of its group in "
                f"the rank table (--cluster): ranks {self.cluster.rank + 1}..{self.cluster.rank + tp - 1} "
                f"with tp_group {self.cluster.rank}")
        if streamed:
            raise FailedPrecondition(f"streamed KV migration (MIGRATE_PROGRESSIVE) is not supported with "
                                     f"--tp {tp}")
        return mover

    def _all_layers(self, batch: Batch, layers: range) -> wire.Runs:
        """The runs of a batch whose every layer is in its pages: one run over all of them."""
        seqs = seq_pages(batch)
        return lambda skips: runs(self.geometry(), with_skips(seqs, skips), layers, streamed=False)

    def _take(self, spec: BatchSpec) -> Batch:
        """(Engine thread) the cached batch named by `spec`, out of the store, checked against `spec`."""
        return take_for_migration(self.engine, spec)

    def _free(self, batch: Batch) -> None:
        """(Engine thread) give the batch's pages back."""
        self.engine.blocks.free(batch.pages())

    # --------------------------------------------------------------------------- receiver
    def immigrate(
        self,
        spec: BatchSpec,
        peer: int,
        call_remaining: float | None,
        cancelled: threading.Event | None = None,
        after_reply: Defer = _now,
    ) -> ImmigratedBatch:
        """Admit the batch (sharing the prompt pages cached here), receive every layer of the rest of
        its prompt KV from `peer`, adopt it (decode-ready)."""
        self.check_group()
        self.check_peer(peer)
        deadline = self.deadline(call_remaining)
        layers = range(self.engine.runner.num_layers)
        start = time.perf_counter()
        batch = self.on_engine(lambda: self.admit(spec), deadline, undo=self.drop_incoming)
        admitted = time.perf_counter()
        try:
            self.receive(batch, peer, layers, deadline, cancelled)
        except BaseException:
            self.later(lambda: self.drop_incoming(batch))
            raise
        info = self.on_engine(lambda: self.adopt(batch), deadline, undo=self._clear_adopted)
        after_reply(_rate_line("received", batch, self.geometry(), layers, start, admitted))
        return info

    def receive(
        self,
        batch: Batch,
        peer: int,
        layers: range,
        deadline: Deadline,
        cancelled: threading.Event | None = None,
    ) -> None:
        """Wait for this batch's turn on the stream from `peer`, check its header, receive `layers`."""
        fabric = self.cluster.fabric
        geometry, seqs = self.geometry(), seq_pages(batch)
        nbytes = total_bytes(geometry, seqs, layers)
        try:
            header = self.turns.claim(
                peer,
                int(batch.id),
                lambda: wire.read_header(fabric, peer, deadline, cancelled),
                deadline.at,
                cancelled,
                lambda late: wire.refuse(fabric, peer, late, _late_reason(late, fabric.rank), deadline),
            )
            try:
                if header.layers != layers or header.nbytes != nbytes:
                    reason = (
                        f"batch {batch.id}: the sender moves layers {_span(header.layers)} / "
                        f"{header.nbytes} bytes, this replica expects {_span(layers)} / {nbytes} bytes"
                    )
                    wire.refuse(fabric, peer, header, reason, deadline)
                    raise FailedPrecondition(reason)
                skips = skipped_pages(batch, self.engine.block_size)
                kept = receiver_runs(batch, geometry, with_skips(seqs, skips), layers, header)
                mover = self.mover()
                flat = [region for run in kept for region in run]
                jobs = [] if mover is None else [mover.start(OpKind.RECV, peer, flat, header.nonce,
                                                             deadline)]
                settled(mover, jobs, deadline, lambda: wire.recv_kv(fabric, peer, header, skips, kept,
                                                                     deadline))
            finally:
                self.turns.release(peer)
        except TransferError as exc:
            raise wire.as_replica_error(exc) from exc

    def admit(self, spec: BatchSpec) -> Batch:
        """(Engine thread) validate and allocate like a prefill, sharing the full prompt pages the
        prefix cache holds (the sender skips them); the id counts as present from now on."""
        if spec.id in self.incoming:
            raise AlreadyExists(f"batch {spec.id} is already being immigrated")
        batch = self.engine.admit(spec, reuse=Reuse.WHOLE_PROMPT)
        self.incoming.add(spec.id)
        return batch

    def adopt(self, batch: Batch) -> ImmigratedBatch:
        """(Engine thread) cache the received batch; on failure its pages go back."""
        self.incoming.discard(batch.id)
        try:
            info = self.engine.adopt(batch)
        except BaseException:
            self._free(batch)
            raise
        return self.immigrated(batch, info)

    def immigrated(self, batch: Batch, info: CachedBatchInfo) -> ImmigratedBatch:
        """(Engine thread) the answer for a received batch: what its prompts took from the cache."""
        reused = tuple(r.cached_tokens for r in batch)
        return ImmigratedBatch(info, reused, tuple(self.engine.blocks.take_evicted()))

    def drop_incoming(self, batch: Batch) -> None:
        """(Engine thread) a receive failed: forget the id, free the pages."""
        self.incoming.discard(batch.id)
        self._free(batch)

    def _clear_adopted(self, done: ImmigratedBatch) -> None:
        if done.info.id in self.engine.store:
            self.engine.clear(done.info.id)


def take_for_migration(engine: Engine, spec: BatchSpec) -> Batch:
    """(Engine thread) the cached batch named by `spec`, out of the store, checked against `spec`:
    the same requests, none decoded here yet (only the prompt's KV moves)."""
    batch = engine.store.get(spec.id)
    if batch.prefilling:
        raise FailedPrecondition(f"batch {spec.id} is still being prefilled in chunks")
    wanted = tuple(r.id for r in spec.requests)
    if batch.request_ids != wanted:
        raise InvalidArgument(f"batch {spec.id} holds {list(batch.request_ids)}, not {list(wanted)}")
    advanced = [r.id for r in batch if r.num_cached > r.prompt_len]
    if advanced:
        raise FailedPrecondition(f"requests {advanced} were decoded here: migrate right after prefill")
    return engine.store.pop(spec.id)


def seq_pages(batch: Batch) -> list[SeqPages]:
    """The batch's requests as (prompt length, pages), in batch order."""
    return [SeqPages(r.prompt_len, tuple(r.pages)) for r in batch]


def receiver_runs(
    batch: Batch, geometry: CacheGeometry, seqs: list[SeqPages], layers: range, header: Header
) -> list[list[Region]]:
    """The runs the sender sends, in its order: one over every layer, or one per layer of each
    forward of its (chunked) prefill."""
    if not header.streamed:
        return runs(geometry, seqs, layers, streamed=False)
    chunkable = [not r.spec.prefill_logprobs for r in batch]
    schedule = chunk_schedule([s.prompt_len for s in seqs], chunkable, header.chunk_tokens)
    return forward_runs(geometry, seqs, layers, schedule)


def skipped_pages(batch: Batch, block_size: int) -> tuple[int, ...]:
    """(Receiver) per request, the leading prompt pages admission took from the prefix cache."""
    return tuple(r.cached_tokens // block_size for r in batch)


def _rate_line(
    verb: str, batch: Batch, geometry: CacheGeometry, layers: range, start: float, ready: float
) -> Callable[[], None]:
    """One line per migration: bytes, time (engine part and total) and rate, like the reference's log.

    The times are taken now; the returned function writes the line (after the answer went out).
    """
    nbytes = total_bytes(geometry, seq_pages(batch), layers)
    total = time.perf_counter() - start
    args = (batch.id, verb, nbytes / 2**20, _span(layers), total * 1e3, (ready - start) * 1e3)
    rate = nbytes / 1e9 / max(total, 1e-9)
    return lambda: log.info(
        "batch %d: %s %.1f MiB of KV (layers %s) in %.1f ms (engine %.1f ms): %.2f GB/s", *args, rate
    )


def _late_reason(header: Header, rank: int) -> str:
    return f"rank {rank} gave up waiting for the migration of batch {header.batch_id} before it came"


def _span(layers: range) -> str:
    return f"[{layers.start}, {layers.stop})"
