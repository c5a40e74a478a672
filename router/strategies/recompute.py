"""`recompute`: only token ids move. P's copy of the batch is freed; D prefills prompt + the tokens
generated so far again (a new run of each request: `RequestState.resent`), then decodes on.

The other strategies fall back to this one for a batch whose replicas lack a migration RPC.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.batches import Arrived, DecodeSide, LiveBatch, Member, member_blocks
from router.migration import Abandoned, Migrations
from router.registry import ReplicaHandle
from router.requests import TOKEN_ID_BYTES
from router.strategies.base import MigrationStrategy

NAME = "recompute"


@dataclass(frozen=True)
class Reprefill:
    """Requests to prefill again on the decode replica: prompt + tokens so far (an `Arrival`).

    `promised` pages were reserved for them on that replica by the hand-off that sent them;
    `label` names the move in routes and metrics.
    """

    members: tuple[Member, ...]
    promised: int
    sent_at: float
    label: str = NAME

    async def take(self, side: DecodeSide) -> list[Arrived]:
        """Prefill the requests still wanted here; their batches merge like migrated ones."""
        side.replica.promised -= self.promised
        side.replica.inbound -= 1 if self.promised else 0
        members = [m for m in self.members if m.wanted]
        if not members:
            return []
        arrived = [Arrived(live, {}) for live in await side.prefill_here(members)]
        elapsed = side.now() - self.sent_at
        for m in members:
            m.state.sent_to(side.replica.id, elapsed)
        sent = sum(TOKEN_ID_BYTES * len(m.request.input_ids) for m in members)
        side.record_migration(self.label, sent, elapsed)
        return arrived


class Recompute(MigrationStrategy):
    """Send the tokens, not the KV."""

    name = NAME

    async def hand_off(self, moves: Migrations, src: ReplicaHandle, live: LiveBatch) -> None:
        await send_tokens(moves, src, live, self)


async def send_tokens(moves: Migrations, src: ReplicaHandle, live: LiveBatch, via: MigrationStrategy,
                      label: str = NAME) -> None:
    """Free the batch on `src`; a destination chosen by `via` prefills its requests again (routes
    and metrics name the move `label`)."""
    members = [m for m in live.members.values() if m.wanted]
    await moves.clear(src, live.id)
    src.state.release(live.members)
    moves.wakeups.pages(src.id)
    if not members:
        return
    fresh = []
    for m in members:
        m.state.resent(label)
        fresh.append(Member.now(m.state))
    need = sum(member_blocks(m, live.block_size) for m in fresh)
    try:
        # the fresh runs as the batch: the routing rule sees their prompts; all gone → Abandoned
        runs = LiveBatch(live.cached, {m.id: m for m in fresh}, live.block_size)
        dst = await via.reserve(moves, src, need, runs)
    except Abandoned:
        moves.requests.requeue(fresh, "prefill replica died")
        return
    target = dst or src
    for m in fresh:
        m.state.sent_to(target.id)
    target.inbox.append(Reprefill(tuple(fresh), need if dst else 0, moves.now(), label))
    moves.wakeups.replica(target.id)


STRATEGY = Recompute()
