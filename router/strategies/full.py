"""`full`: after the prefill on P, Migrate on P ‖ Immigrate on D, then D merges the batch.

D is the decode replica with the most free pages and an inbound slot (`MigrationStrategy.destination`).
The batch waits for one on P (counted in P's pending migrations); without any decode replica P
decodes it itself. A replica answering UNIMPLEMENTED for the migration sends the batch by `recompute`.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.batches import LiveBatch
from router.errors import PeerFailed, ReplicaUnavailable, ReplicaUnimplemented
from router.migration import Abandoned, MigrationFailed, Migrations
from router.registry import ReplicaHandle
from router.strategies.base import MigrationStrategy
from router.strategies.recompute import send_tokens


class Full(MigrationStrategy):
    """Whole-batch KV migration right after the prefill."""

    name = "full"

    async def hand_off(self, moves: Migrations, src: ReplicaHandle, live: LiveBatch) -> None:
        need = sum(live.pages().values())
        try:
            dst = await self.reserve(moves, src, need, live)
        except Abandoned:
            if src.state.alive:  # every client went away while it waited: free it on P
                await moves.prune(src, live)
            return
        if dst is None:
            moves.decode_here(src, live)
            return
        try:
            await self.send_kv(moves, src, dst, live)
        finally:
            moves.unreserve(dst, need)

    async def send_kv(self, moves: Migrations, src: ReplicaHandle, dst: ReplicaHandle, live: LiveBatch
                      ) -> None:
        """Move the batch's KV from `src` to the reserved `dst`, where its loop merges it."""
        pruned = await moves.prune(src, live)
        if pruned is None:
            return
        t0 = moves.now()
        try:
            got = await moves.transfer_kv(src, dst, pruned)
        except MigrationFailed as failed:
            await self._failed(moves, src, dst, pruned, failed.errors)
            return
        src.state.release(pruned.members)
        arrived = LiveBatch.of(got, list(pruned.members.values()), pruned.block_size)
        moves.arrive(dst, arrived, self.name, moves.now() - t0)

    async def _failed(self, moves: Migrations, src: ReplicaHandle, dst: ReplicaHandle, live: LiveBatch,
                      errors: Sequence[Exception]) -> None:
        """Fall back, re-run or fail the batch's requests by what failed."""
        await moves.clear(dst, live.id)
        if any(isinstance(e, ReplicaUnimplemented) for e in errors):
            moves.warn_once(self.name, errors)
            await send_tokens(moves, src, live, self)
            return
        members = list(live.members.values())
        # a side that was unreachable was marked dead when its call failed (`Migrations.pair`): not
        # again now, when it may have come back meanwhile
        await moves.clear(src, live.id)
        src.state.release(live.members)
        if any(isinstance(e, ReplicaUnavailable | PeerFailed) for e in errors):  # the requests are fine
            moves.requests.requeue(members, f"migration failed: {errors[0]}")
        else:
            moves.requests.fail(members, f"migration of batch {live.id} failed: {errors[0]}", 502)


STRATEGY = Full()
