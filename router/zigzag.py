"""Live scaling, router side: a replica still receiving weights prefills layer by layer (zigzag), a
loaded prefill replica takes its batches over (relay), and the split KV goes to one decode replica.

```
 NEW_PREFILL replica N (weights arriving)          OLD_PREFILL replica O (loaded)
  once its embedding landed: take a batch ─►         Relay(N, rank O) ─► (batch, seq) of N's oldest
  ZagPrefill(seq) (a task), at most `limit()`          task; its ZagPrefill answers "relayed at k"
  outstanding (a ramp: 4, lowered as loading goes)   k ≥ 1: PrefillV2(NAIVE_PP|IMMIGRATE, resume k,
  a zag that finished here ─► hand-off (strategy)      peer N) on O ─► first tokens; KV [0,k) on N,
  weights complete ─► REFRACTORY_PREFILL               [k,L) on O ─► MigratePartial FIRST (N) ‖
  (relays may take any task but the oldest)            SECOND (O) ─► one decode replica D
  no zag task left ─► PREFILL                        k = 0: ClearCache on N, a normal prefill on O
                                                     no new replica left ─► PREFILL
```
Tokens are the same whichever way a batch went: the relayed half resumes from the exact
activation, and the decode replica gets every layer's KV. A relay needs a decode replica to
receive both halves; without one, the old replica waits and the new one finishes its batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Protocol

from router.batches import LiveBatch, Member, member_blocks, spec_for
from router.cluster import Cluster
from router.episode import Episode, ZagTask
from router.errors import ReplicaCallError
from router.migration import Abandoned, MigrationFailed, Migrations
from router.registry import ReplicaHandle
from router.replicas import State, Trigger
from router.strategies.base import MigrationStrategy, most_free_pages
from router.types import BatchId, PrefillCase, RequestId, ZagOutcome
from router.wakeup import Wakeups

log = logging.getLogger("pdcluster.router")

# How often a new replica whose embedding has not landed yet asks whether it has.
EMBED_POLL_S = 0.05
RELAYED_CASE = PrefillCase.NAIVE_PP | PrefillCase.IMMIGRATE
STRATEGY_NAME = "zigzag"  # the route's strategy of a batch split between two replicas


class ReplicaWorker(Protocol):
    """The parts of a replica's loop (`loops.ReplicaWorker`) the zigzag steps use."""

    h: ReplicaHandle
    cluster: Cluster
    wakeups: Wakeups

    async def take_batch(self) -> tuple[BatchId, list[Member]] | None:
        """The next batch from the queue that fits this replica."""
        ...

    async def run_prefill(self, members: list[Member], batch_id: BatchId,
                          case: PrefillCase = PrefillCase.NORMAL, peer: ReplicaHandle | None = None,
                          raise_errors: bool = False, from_queue: bool = True,
                          resume: int | None = None) -> LiveBatch | None:
        """PrefillV2 here; the first tokens are streamed; the batch as cached."""
        ...


def hand_off_strategy(strategy: MigrationStrategy, fallback: MigrationStrategy) -> MigrationStrategy:
    """How a batch prefilled on a new replica leaves it: by the strategy in use, unless that one does
    not migrate (colocated, mutate: a replica still loading must not decode), then by `fallback`."""
    return fallback if strategy.colocates or strategy.makes_decode_replicas else strategy


# ---- the new replica -------------------------------------------------------------------------------

async def zig_step(worker: ReplicaWorker, moves: Migrations, handoff: MigrationStrategy) -> bool:
    """One step of a NEW_PREFILL or REFRACTORY_PREFILL replica's loop; True when it did work."""
    h = worker.h
    episode = h.zigzag or _start(h, moves.now())
    did = await _collect(worker, episode, moves, handoff)
    if h.state.role is State.NEW_PREFILL and await _embed_ready(h, episode, moves.now()):
        did = await _admit(worker, episode, moves.now()) or did
    if h.state.role is State.REFRACTORY_PREFILL and not episode.tasks:
        h.zigzag = None
        h.state.move(State.PREFILL, Trigger.ZIGZAG_DONE)
        worker.wakeups.all()
        return True
    return did


def _start(h: ReplicaHandle, now: float) -> Episode:
    h.zigzag = Episode(now)
    return h.zigzag


async def _embed_ready(h: ReplicaHandle, episode: Episode, now: float) -> bool:
    """Whether the replica's embedding has landed (asked at most every `EMBED_POLL_S`)."""
    if episode.embed_ready or now - episode.embed_checked < EMBED_POLL_S:
        return episode.embed_ready
    episode.embed_checked = now
    with contextlib.suppress(ReplicaCallError):
        h.state.info = await h.client.info()
        episode.embed_ready = h.state.info.embed_ready
    return episode.embed_ready


async def _admit(worker: ReplicaWorker, episode: Episode, now: float) -> bool:
    """Send the next batch from the queue as a ZagPrefill, within the ramp's limit."""
    if len(episode.tasks) >= episode.limit(now):
        return False
    taken = await worker.take_batch()
    if taken is None:
        return False
    batch_id, members = taken
    h = worker.h
    pages = {m.id: member_blocks(m, h.block_size) for m in members}
    h.state.hold(pages)
    for m in members:
        m.state.batched(STRATEGY_NAME)
        m.state.zigzag(h.id)
    seq, episode.next_seq = episode.next_seq, episode.next_seq + 1
    call = asyncio.create_task(h.client.zag_prefill(spec_for(batch_id, members, h.block_size), seq))
    call.add_done_callback(lambda _done: worker.wakeups.all())
    episode.tasks.append(ZagTask(seq, batch_id, members, pages, call))
    worker.wakeups.all()  # an old replica's loop may relay it
    return True


async def _collect(worker: ReplicaWorker, episode: Episode, moves: Migrations,
                   handoff: MigrationStrategy) -> bool:
    """Finish the tasks whose ZagPrefill answered (those an old replica took are finished there; a
    relayed outcome can arrive before the Relay call's answer marks its task taken: it is left to
    the old replica that asked for it)."""
    done = [t for t in episode.tasks if t.call.done() and not t.taken and not _relayed(t)]
    for task in done:
        episode.tasks.remove(task)
        await _finished_here(worker, task, moves, handoff)
    return bool(done)


def _relayed(task: ZagTask) -> bool:
    """The task's ZagPrefill answered that another replica took the batch over."""
    call = task.call
    return not call.cancelled() and call.exception() is None and call.result().resume is not None


async def _finished_here(worker: ReplicaWorker, task: ZagTask, moves: Migrations,
                         handoff: MigrationStrategy) -> None:
    """A batch prefilled here in full: stream its first tokens and hand it off like any prefill."""
    h = worker.h
    try:
        outcome = task.call.result()
    except (ReplicaCallError, asyncio.CancelledError) as exc:
        h.state.release(task.pages)
        if isinstance(exc, ReplicaCallError):
            worker.cluster.on_error(h, exc, task.members)
        else:
            moves.requests.requeue(task.members, "the new replica's load was rolled back")
        return
    live = _delivered(worker, h, task.members, outcome)
    if live is not None:
        moves.spawn(h, handoff.hand_off(moves, h, live))


def _delivered(worker: ReplicaWorker, h: ReplicaHandle, members: list[Member], outcome: ZagOutcome
               ) -> LiveBatch | None:
    worker.cluster.deliver(outcome.result, {m.id: m for m in members})
    if outcome.result.batch is None:
        h.state.release(m.id for m in members)
        return None
    return LiveBatch.of(outcome.result.batch, members, h.block_size)


async def abandon(h: ReplicaHandle, moves: Migrations) -> None:
    """The new replica's load failed or it died: cancel its zigzag prefills (the replica drops
    them and frees their pages) and re-run their requests elsewhere (a relayed task's old replica
    does that for its own)."""
    episode, h.zigzag = h.zigzag, None
    if episode is None:
        return
    mine = [t for t in episode.tasks if not t.taken]
    for task in episode.tasks:
        task.call.cancel()
    await asyncio.gather(*(t.call for t in episode.tasks), return_exceptions=True)
    for task in mine:
        h.state.release(task.pages)
        moves.requests.requeue(task.members, f"replica {h.id} stopped loading")


# ---- the old replica -------------------------------------------------------------------------------

async def relay_step(worker: ReplicaWorker, moves: Migrations, handoff: MigrationStrategy) -> bool:
    """One step of an OLD_PREFILL replica's loop: take over one batch of a new replica."""
    h = worker.h
    news = worker.cluster.zigzag_replicas()
    if not news:
        h.state.move(State.PREFILL, Trigger.RELAY_END)
        worker.wakeups.all()
        return True
    if not worker.cluster.has_decode():
        return False
    for new in news:
        episode = new.zigzag
        if episode is None or not episode.open_tasks():
            continue
        if await _relay_from(worker, new, episode, moves, handoff):
            return True
    return False


async def _relay_from(worker: ReplicaWorker, new: ReplicaHandle, episode: Episode, moves: Migrations,
                      handoff: MigrationStrategy) -> bool:
    old = worker.h
    relax = new.state.role is State.REFRACTORY_PREFILL  # its oldest task is about to finish there
    try:
        got = await new.client.relay(old.rank, relax)
    except ReplicaCallError as exc:
        log.warning("relay from replica %s failed: %s", new.id, exc)
        return False
    task = episode.task(got[0]) if got is not None else None
    if task is None:
        return False
    task.taken = True  # from here on this loop owns the task: its outcome, its pages, its requests
    try:
        outcome = await task.call
    except (ReplicaCallError, asyncio.CancelledError) as exc:
        new.state.release(task.pages)
        moves.requests.requeue(task.members, f"relayed prefill failed on replica {new.id}: {exc!r}")
        return True
    finally:
        if task in episode.tasks:
            episode.tasks.remove(task)
        worker.wakeups.all()
    await _take_over(worker, new, task, outcome, moves, handoff)
    return True


async def _take_over(worker: ReplicaWorker, new: ReplicaHandle, task: ZagTask, outcome: ZagOutcome,
                     moves: Migrations, handoff: MigrationStrategy) -> None:
    """Finish a relayed batch on the old replica and send its KV on."""
    old = worker.h
    worker.cluster.record("relay", new=new.id, old=old.id, batch=task.batch_id, seq=task.seq,
                          layer=outcome.resume, requests=len(task.members))
    if outcome.resume is None:  # it finished before the relay took effect
        live = _delivered(worker, new, task.members, outcome)
        if live is not None:
            moves.spawn(new, handoff.hand_off(moves, new, live))
        return
    for m in task.members:
        m.state.relayed(old.id)
    if outcome.resume == 0:  # not started: nothing of it stays on the new replica
        await moves.clear(new, task.batch_id)
        new.state.release(task.pages)
        live = await worker.run_prefill(task.members, task.batch_id, from_queue=False)
        if live is not None:
            moves.spawn(old, handoff.hand_off(moves, old, live))
        return
    live = await worker.run_prefill(task.members, task.batch_id, RELAYED_CASE, new, from_queue=False,
                                    resume=outcome.resume)
    if live is None:  # failed (its requests re-run) or every request ended at its first token
        await moves.clear(new, task.batch_id)
        new.state.release(task.pages)
        return
    moves.spawn(old, send_halves(moves, new, old, live, task.pages, outcome.resume))


async def send_halves(moves: Migrations, new: ReplicaHandle, old: ReplicaHandle, live: LiveBatch,
                      new_pages: dict[RequestId, int], split: int) -> None:
    """Layers [0, split) from the new replica and [split, L) from the old one into one decode replica."""
    need = sum(live.pages().values())
    try:
        dst = await moves.reserve(old, need, live, most_free_pages, wait_for_decode=True)
    except Abandoned:
        await _drop_both(moves, new, old, live, new_pages, None)
        return
    if dst is None:  # no decode replica any more: the halves cannot meet
        await _drop_both(moves, new, old, live, new_pages, "no decode replica to receive a split batch")
        return
    t0 = moves.now()
    try:
        got = await moves.transfer_halves(new, old, dst, live, split)
    except MigrationFailed as failed:
        await moves.clear(dst, live.id)
        await _drop_both(moves, new, old, live, new_pages, f"split migration failed: {failed}")
        return
    finally:
        moves.unreserve(dst, need)
    new.state.release(new_pages)
    old.state.release(live.members)
    moves.arrive(dst, LiveBatch.of(got, list(live.members.values()), live.block_size), STRATEGY_NAME,
                 moves.now() - t0)


async def _drop_both(moves: Migrations, new: ReplicaHandle, old: ReplicaHandle, live: LiveBatch,
                     new_pages: dict[RequestId, int], reason: str | None) -> None:
    """Free a split batch on both replicas; re-run its requests (unless nobody wants them)."""
    for handle in (new, old):
        await moves.clear(handle, live.id)
    new.state.release(new_pages)
    old.state.release(live.members)
    if reason is not None:
        moves.requests.requeue(_wanted(live.members.values()), reason)


def _wanted(members: Iterable[Member]) -> list[Member]:
    return [m for m in members if m.wanted]
