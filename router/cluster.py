"""`Cluster`: what a replica's loop may ask of the cluster, and nothing more.

A loop drives one replica (`loops.ReplicaWorker`); everything that concerns other replicas or the
requests as a whole goes through this protocol, which `scheduler.ClusterScheduler` implements.

```
 ReplicaWorker ── queued / take_batch / deliver / on_error ──► requests (queue, streams)
               ── strategy / has_decode / settle_roles ──► roles and the strategy in use
               ── moves ──► the migration queue (hand-offs of prefilled batches)
               ── zigzag_replicas ──► new prefill replicas an old one takes batches over from
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from router.batches import Member
from router.errors import ReplicaCallError
from router.migration import Migrations
from router.registry import ReplicaHandle
from router.strategies.base import MigrationStrategy
from router.types import BatchId, RequestId, StepResult


@dataclass(frozen=True)
class LoopLimits:
    """The router config a loop needs."""

    max_pending_migrations: int  # prefilled batches (and prefills in flight) one prefill replica may hold
    max_batch_prefill_tokens: int  # prompt tokens per prefill (a re-prefill is cut to it)
    prefill_chunk_tokens: int = 0  # colocated: a longer batch is prefilled a chunk per loop step (0: never)
    prefill_chunk_share: float = 1.0  # of a colocated replica's time chunks may take while a batch decodes


class Cluster(Protocol):
    """The cluster as one replica's loop sees it."""

    clock: Callable[[], float]
    """The router's clock (monotonic seconds; virtual ones in `pdcluster simulate`): every measured
    step time is read on it, never on the wall clock."""

    @property
    def stopping(self) -> bool:
        """The router is shutting down: loops end."""
        ...

    @property
    def strategy(self) -> MigrationStrategy:
        """The migration strategy for batches cut from now on."""
        ...

    @property
    def moves(self) -> Migrations:
        """The migration queue prefilled batches are handed to."""
        ...

    def has_decode(self) -> bool:
        """A decode replica exists (else prefill replicas decode their own batches)."""
        ...

    def queued(self) -> tuple[int, int]:
        """Requests and prompt tokens waiting for a prefill."""
        ...

    def take_batch(self, replica: ReplicaHandle) -> tuple[BatchId, list[Member]] | None:
        """The next batch from the queue that fits `replica`'s free pages and the batch budgets."""
        ...

    def new_batch_id(self) -> BatchId:
        """An unused batch id (a re-prefill's)."""
        ...

    def deliver(self, result: StepResult, members: Mapping[RequestId, Member]) -> None:
        """Stream one step's generations to their requests."""
        ...

    def on_error(self, handle: ReplicaHandle, exc: ReplicaCallError, members: Iterable[Member]) -> None:
        """A call on `handle` failed: re-run, retry or fail these requests by what failed."""
        ...

    def prefill_done(self, replica: ReplicaHandle, members: Iterable[Member], result: StepResult) -> None:
        """`replica` prefilled `members` (the router's prefix index learns what it now holds)."""
        ...

    def step_done(self, replica: ReplicaHandle, result: StepResult) -> None:
        """A decode step on `replica` answered (the prefix index drops the pages it evicted)."""
        ...

    def settle_roles(self) -> None:
        """Keep the roles the cluster needs (an empty decode replica may have to become prefill)."""
        ...

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill call of `tokens` prompt tokens took `seconds` (measured for the planner)."""
        ...

    def record(self, kind: str, **fields: object) -> None:
        """Write a record to the router's timeline (`--timeline`)."""
        ...

    def zigzag_replicas(self) -> list[ReplicaHandle]:
        """Replicas prefilling layer by layer while (or just after) their weights arrive."""
        ...
