"""`mutate`: no transfer. The prefill replica becomes a decode replica and decodes its own batch;
an empty decode replica takes the prefill role (`Replicas.settle_roles`).
"""

from __future__ import annotations

import logging

from router.batches import LiveBatch
from router.migration import Migrations
from router.registry import ReplicaHandle
from router.replicas import State, Trigger
from router.strategies.base import MigrationStrategy

log = logging.getLogger("pdcluster.router")


class Mutate(MigrationStrategy):
    """Prefill → decode role change instead of a KV transfer."""

    name = "mutate"
    makes_decode_replicas = True

    async def hand_off(self, moves: Migrations, src: ReplicaHandle, live: LiveBatch) -> None:
        if src.state.role is State.PREFILL:
            src.state.move(State.MUTATING_TO_DECODE, Trigger.MUTATE)
            src.state.move(State.DECODE, Trigger.MUTATED)
            log.info("replica %s mutated to decode", src.id)
        moves.decode_here(src, live)
        moves.host.settle_roles()


STRATEGY = Mutate()
