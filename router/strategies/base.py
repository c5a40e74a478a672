"""The migration-strategy interface: what a strategy decides, and what it is given to act with.

```
 queue ─► prefill loop of P ── strategy.prefill(job) ─► batch cached on P
                                    │ moves.spawn(P, strategy.hand_off(moves, P, batch))  (a task)
                                    ▼
                 strategy.hand_off: what to do after the prefill; where the KV goes
                 (strategy.reserve → strategy.destination); what lands in D's inbox
                                    ▼
            D's loop: an `Arrived` batch merges into its running batch; any other inbox item
            (`batches.Arrival`) is first `take`n — how the decode side takes it (e.g. re-prefills)
```
A strategy is one module in this package that sets `STRATEGY = YourStrategy()`; it is found by its
`name` (`--strategy NAME`, admin `SetMigrationStrategy{name: NAME}`). See router/README.md.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol

from router.batches import LiveBatch, Member
from router.migration import Migrations
from router.registry import ReplicaHandle
from router.replicas import ReplicaState, State
from router.states import DRAINING
from router.types import BatchId, PrefillCase


class Mode(enum.Enum):
    """What a replica's loop step does."""

    PREFILL = "prefill"  # prefill batches from the queue and hand them off
    DECODE = "decode"  # merge what arrived into the running batch, one step
    COLOCATED = "colocated"  # prefill from the queue into the running batch, one step
    DRAIN = "drain"  # decode what is left, then become idle
    IDLE = "idle"  # nothing


class PrefillJob(Protocol):
    """A batch cut from the queue for one prefill replica, as its loop gives it to the strategy."""

    @property
    def replica(self) -> ReplicaHandle:
        """The prefill replica."""
        ...

    @property
    def batch_id(self) -> BatchId:
        """The new batch's id."""
        ...

    @property
    def members(self) -> list[Member]:
        """Its requests, at their current run."""
        ...

    @property
    def moves(self) -> Migrations:
        """The migration queue (reservations, transfers, arrivals, hand-off tasks)."""
        ...

    async def prefill(self, case: PrefillCase = PrefillCase.NORMAL, peer: ReplicaHandle | None = None,
                      raise_errors: bool = False) -> LiveBatch | None:
        """PrefillV2 on the replica; the first tokens are streamed. The batch as cached (pruned to
        the requests still wanted), or, for a migrating `case`, as the replica sent it to `peer`.

        A failed call forgets its pages and, unless `raise_errors`, re-runs or fails the requests.
        """
        ...


def most_free_pages(candidates: Sequence[ReplicaState], need_blocks: int, max_inbound: int
                    ) -> ReplicaState | None:
    """The decode replica with the most free pages that fits `need_blocks` and has an inbound slot."""
    best: ReplicaState | None = None
    best_key = (0, 0, 0)
    for r in candidates:  # one pass: a hand-off looks at every decode replica
        if r.role is not State.DECODE or r.inbound >= max_inbound:
            continue
        free = r.free_blocks
        if free >= need_blocks and (best is None or (free, -r.inbound, -r.id) > best_key):
            best, best_key = r, (free, -r.inbound, -r.id)
    return best


class MigrationStrategy(ABC):
    """How a prefilled batch reaches decoding. Subclass it, set `name`, implement `hand_off`."""

    name: ClassVar[str] = ""
    #: prefills may be on the wire `loops.PREFILL_DEPTH` at a time (False: the loop awaits `prefill`)
    pipelined: ClassVar[bool] = True
    #: every serving replica prefills and decodes (no hand-off at all)
    colocates: ClassVar[bool] = False
    #: the strategy turns prefill replicas into decode replicas itself: a cluster without a decode
    #: replica still disaggregates (else its prefill replicas decode their own batches meanwhile)
    makes_decode_replicas: ClassVar[bool] = False

    def mode(self, role: State, has_decode: bool) -> Mode:
        """The loop mode of a replica in `role` under this strategy."""
        if role is State.COLOCATED:
            return Mode.COLOCATED
        if role is State.PREFILL:
            alone = not has_decode and not self.makes_decode_replicas
            return Mode.COLOCATED if self.colocates or alone else Mode.PREFILL
        if role in (State.DECODE, State.MUTATING_TO_DECODE):
            return Mode.COLOCATED if self.colocates else Mode.DECODE
        if role in DRAINING:
            return Mode.DRAIN
        return Mode.IDLE

    async def prefill(self, job: PrefillJob) -> LiveBatch | None:
        """Run the batch's prefill; the batch to hand off (None: nothing left to hand off)."""
        return await job.prefill()

    @abstractmethod
    async def hand_off(self, moves: Migrations, src: ReplicaHandle, live: LiveBatch) -> None:
        """After the prefill on `src`: see `live` to a decoding replica (a task of the queue)."""

    def destination(self, candidates: Sequence[ReplicaState], need: int, max_inbound: int
                    ) -> ReplicaState | None:
        """Where the KV goes: the decode replica with the most free pages (None: wait)."""
        return most_free_pages(candidates, need, max_inbound)

    async def reserve(self, moves: Migrations, src: ReplicaHandle, need: int,
                      live: LiveBatch | None = None) -> ReplicaHandle | None:
        """Wait for `destination` to name a replica and reserve `need` pages there (see
        `Migrations.reserve`: None = decode on `src`; `Abandoned` when nobody wants the batch)."""
        return await moves.reserve(src, need, live, self.destination, self.makes_decode_replicas)
