"""Batches as the router tracks them: which request (at which run) sits in which cached batch,
and the items a decode replica's inbox holds.

`Member` pins a request to the run it was batched in: when the request is re-run elsewhere (its
replica died), the old batch's members become stale and their outputs are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from router.queue import blocks_for, request_blocks
from router.replicas import ReplicaState
from router.requests import RequestState
from router.types import BatchId, BatchSpec, CachedBatch, GenerateRequest, RequestId, WireRequest


@dataclass(frozen=True)
class Member:
    """A request inside one batch, at one run."""

    state: RequestState
    run: int
    request: GenerateRequest

    @classmethod
    def now(cls, state: RequestState) -> Member:
        """The request's live run, as it would be sent now."""
        return cls(state, state.run, state.current())

    @property
    def id(self) -> RequestId:
        """The request id (also its id on the replica)."""
        return self.state.id

    @property
    def current(self) -> bool:
        """This batch still holds the request's live run."""
        return self.state.run == self.run

    @property
    def wanted(self) -> bool:
        """Current, not cancelled, not finished: worth keeping in the batch."""
        return self.current and self.state.alive


@dataclass
class LiveBatch:
    """A batch cached on one replica, with the members behind its request ids."""

    cached: CachedBatch
    members: dict[RequestId, Member]
    block_size: int

    @classmethod
    def of(cls, cached: CachedBatch, members: list[Member], block_size: int) -> LiveBatch:
        """Pair a replica's cached batch with the members it names (unknown ids are dropped)."""
        by_id = {m.id: m for m in members}
        return cls(cached, {rid: by_id[rid] for rid in cached.request_ids if rid in by_id}, block_size)

    @property
    def id(self) -> BatchId:
        """The batch id on the replica."""
        return self.cached.id

    def pages(self) -> dict[RequestId, int]:
        """Pages each request holds (the replica's reservation rule, from the run's request)."""
        return {rid: member_blocks(m, self.block_size) for rid, m in self.members.items()}

    def spec(self) -> BatchSpec:
        """The batch as a `Batch` message (for Migrate / Immigrate)."""
        reqs = tuple(WireRequest(m.id, m.request) for m in self.members.values())
        return BatchSpec(self.id, reqs, sum(self.pages().values()) * self.block_size)

    def wanted_ids(self) -> list[RequestId]:
        """Requests still worth keeping."""
        return [rid for rid, m in self.members.items() if m.wanted]


def member_blocks(member: Member, block_size: int) -> int:
    """Pages one member's run reserves on a replica."""
    return request_blocks(member.request, block_size)


def migrated_blocks(member: Member, block_size: int) -> int:
    """Pages a migration moves for one member: those holding its run's prompt (replica/migration/
    plan.py); the rest of its reservation holds nothing yet."""
    return blocks_for(len(member.request.input_ids), block_size)


def spec_for(batch_id: BatchId, members: list[Member], block_size: int) -> BatchSpec:
    """A new batch of these members' current runs."""
    reqs = tuple(WireRequest(m.id, m.request) for m in members)
    blocks = sum(member_blocks(m, block_size) for m in members)
    return BatchSpec(batch_id, reqs, blocks * block_size)


@dataclass(frozen=True)
class Arrived:
    """A batch now cached on the decode replica, to merge into its running batch.

    `last_tokens` maps request id → the token to append before the next step (a migrated batch's
    first token, which the receiver's copy does not have yet); empty for batches prefilled locally.
    """

    batch: LiveBatch
    last_tokens: dict[RequestId, int]


class DecodeSide(Protocol):
    """What an inbox item may ask of the decode replica that takes it."""

    @property
    def replica(self) -> ReplicaState:
        """The decode replica's state (page accounting, id)."""
        ...

    async def prefill_here(self, members: list[Member]) -> list[LiveBatch]:
        """Prefill these requests' current runs on this replica (in groups under the prefill budget)."""
        ...

    def now(self) -> float:
        """The router's clock."""
        ...

    def record_migration(self, strategy: str, nbytes: int, seconds: float) -> None:
        """Count one hand-off in the metrics."""
        ...


class Arrival(Protocol):
    """An inbox item that needs work on the decode replica before it merges (a strategy's own)."""

    async def take(self, side: DecodeSide) -> list[Arrived]:
        """Become batches cached on `side`'s replica (merged into its running batch next step)."""
        ...


InboxItem = Arrived | Arrival


def prefill_groups(members: list[Member], max_tokens: int) -> list[list[Member]]:
    """Consecutive groups of members whose prompts fit `max_tokens` (a larger one goes alone)."""
    groups: list[list[Member]] = []
    used = max_tokens
    for m in members:
        size = len(m.request.input_ids)
        if used + size > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(m)
        used += size
    return groups
