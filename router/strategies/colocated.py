"""`colocated`: no disaggregation. Every serving replica prefills batches from the queue into its
running batch and decodes them (continuous batching); nothing is handed off.
"""

from __future__ import annotations

from router.batches import LiveBatch
from router.migration import Migrations
from router.registry import ReplicaHandle
from router.strategies.base import MigrationStrategy


class Colocated(MigrationStrategy):
    """Prefill and decode on the same replica."""

    name = "colocated"
    colocates = True

    async def hand_off(self, moves: Migrations, src: ReplicaHandle, live: LiveBatch) -> None:
        moves.decode_here(src, live)  # loops never prefill for a hand-off under this strategy


STRATEGY = Colocated()
