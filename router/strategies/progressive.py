"""`progressive`: D is chosen before the prefill; P runs `PrefillV2(MIGRATE_PROGRESSIVE, pipe_peer=D)`,
streaming each layer's KV as it is computed, while D `Immigrate`s it. Nothing stays cached on P.

One batch at a time per prefill replica (the strategy drives both replicas' calls itself). Without a
decode replica P prefills normally and decodes itself. Replicas lacking the RPCs: the batch goes by
`full` (or `recompute`, when the prefill ran but the receiver failed).
"""

from __future__ import annotations

import asyncio
import contextlib

from router.batches import LiveBatch, member_blocks, spec_for
from router.errors import PeerFailed, ReplicaCallError, ReplicaUnavailable, ReplicaUnimplemented
from router.migration import Abandoned, Migrations
from router.registry import ReplicaHandle
from router.strategies.base import MigrationStrategy, PrefillJob
from router.strategies.full import STRATEGY as FULL
from router.strategies.recompute import send_tokens
from router.types import BatchId, PrefillCase


class Progressive(MigrationStrategy):
    """Layer-by-layer KV streaming during the prefill."""

    name = "progressive"
    pipelined = False

    async def prefill(self, job: PrefillJob) -> LiveBatch | None:
        src, moves = job.replica, job.moves
        need = sum(member_blocks(m, src.block_size) for m in job.members)
        try:
            dst = await self.reserve(moves, src, need)
        except Abandoned:
            moves.requests.requeue(job.members, "prefill replica died")
            return None
        if dst is None:
            live = await job.prefill()
            if live is not None:
                moves.decode_here(src, live)
            return None
        try:
            await self._stream(job, dst)
        finally:
            moves.unreserve(dst, need)
        return None

    async def hand_off(self, moves: Migrations, src: ReplicaHandle, live: LiveBatch) -> None:
        await FULL.hand_off(moves, src, live)  # a batch prefilled some other way migrates whole

    async def _stream(self, job: PrefillJob, dst: ReplicaHandle) -> None:
        src, moves = job.replica, job.moves
        spec, t0 = spec_for(job.batch_id, job.members, src.block_size), moves.now()
        receive = asyncio.create_task(dst.client.immigrate(spec, src.ranks, dst.ranks))
        send = asyncio.ensure_future(job.prefill(PrefillCase.MIGRATE_PROGRESSIVE, dst, raise_errors=True))
        # an unreachable receiver is dead now, and the prefill sending to it is cancelled (it would
        # wait for the receiver's answer until its deadline); an unreachable sender likewise
        moves.pair(src, send, dst, receive)
        try:
            live = await send
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this hand-off itself is cancelled (the router stops)
            # nothing to clear on P: a cancelled MIGRATE_PROGRESSIVE prefill frees its batch there
            why = receive.exception() if receive.done() and not receive.cancelled() else "cancelled"
            moves.requests.requeue(job.members, f"migration failed: {why}")
            return
        except ReplicaCallError as exc:
            receive.cancel()
            with contextlib.suppress(BaseException):
                await receive
            await moves.clear(dst, job.batch_id)
            await self._sender_failed(job, exc)
            return
        try:
            got = await receive
        except ReplicaCallError as exc:
            await self._receiver_failed(moves, src, dst, job.batch_id, live, exc)
            return
        # nothing to clear on P: a MIGRATE_PROGRESSIVE prefill never caches its batch there
        src.state.release([m.id for m in job.members])
        moves.arrive(dst, LiveBatch.of(got, job.members, src.block_size), self.name, moves.now() - t0)

    async def _sender_failed(self, job: PrefillJob, exc: ReplicaCallError) -> None:
        """The progressive prefill failed: without the RPC, prefill normally and migrate whole."""
        moves, src = job.moves, job.replica
        if not isinstance(exc, ReplicaUnimplemented):
            moves.host.on_error(src, exc, job.members)
            return
        moves.warn_once(self.name, [exc])
        live = await job.prefill()
        if live is not None:
            moves.spawn(src, FULL.hand_off(moves, src, live))

    async def _receiver_failed(self, moves: Migrations, src: ReplicaHandle, dst: ReplicaHandle,
                               batch_id: BatchId, live: LiveBatch | None, exc: ReplicaCallError) -> None:
        """The prefill ran but the receiver failed: the batch is still on P, send it by recompute."""
        await moves.clear(dst, batch_id)
        # an unreachable receiver was marked dead when its call failed (`Migrations.pair`)
        if isinstance(exc, ReplicaUnimplemented):
            moves.warn_once(self.name, [exc])
        if live is None:
            return
        if isinstance(exc, ReplicaUnavailable | ReplicaUnimplemented | PeerFailed):
            moves.spawn(src, send_tokens(moves, src, live, self))
            return
        await moves.clear(src, live.id)
        src.state.release(live.members)
        moves.requests.fail(list(live.members.values()), f"migration of batch {batch_id} failed: {exc}", 502)


STRATEGY = Progressive()
