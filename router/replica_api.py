"""`ReplicaApi`: the calls the router's core makes on a replica, as plain dataclasses.

The core (loops, migrations, control) depends on this protocol only; `client.ReplicaClient` (the
gRPC edge) implements it, and `main.py` hands the scheduler a `Connect` that builds one per address.
Every call raises a `router.errors.ReplicaCallError` subclass when it fails.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from router.types import (
    BatchId,
    BatchSpec,
    CachedBatch,
    PeerLink,
    PrefillCase,
    ReplicaInfo,
    RequestId,
    StepResult,
    ZagOutcome,
)


class ReplicaApi(Protocol):
    """One replica, as the router drives it (`generate.v2`, see docs/replica-rpc.md)."""

    address: str

    async def info(self) -> ReplicaInfo:
        """Model and cache facts."""
        ...

    async def health(self) -> str:
        """'serving', 'loading' or 'inactive'; `ReplicaUnavailable` when it cannot serve (a
        tensor-parallel group that lost a rank answers Info but not Health)."""
        ...

    async def prefill(
        self, batch: BatchSpec, case: PrefillCase = PrefillCase.NORMAL, pipe_peer: Sequence[int] = (),
        resume: int | None = None, chunk_tokens: int = 0,
    ) -> StepResult:
        """PrefillV2 of a new batch (with migration flags when `case` asks for them); `resume`: a
        relayed batch's layer (NAIVE_PP|IMMIGRATE from `pipe_peer`; 0 = at the embedding);
        `chunk_tokens`: at most that many prompt tokens now (no generations: `prefill_chunk` goes on)."""
        ...

    async def prefill_chunk(self, batch_id: BatchId, chunk_tokens: int) -> StepResult:
        """The next chunk of a prefilling batch; its first tokens once every prompt is computed."""
        ...

    async def zag_prefill(self, batch: BatchSpec, seq: int) -> ZagOutcome:
        """Layer-by-layer prefill on a replica still receiving weights, admitted in `seq` order."""
        ...

    async def relay(self, old_rank: int, relax_not_head: bool) -> tuple[BatchId, int] | None:
        """Hand a queued layer-by-layer prefill to `old_rank`: (batch id, seq), or None."""
        ...

    async def migrate_partial(self, batch: BatchSpec, first: bool, split: int, src: Sequence[int],
                              dst: Sequence[int]) -> CachedBatch:
        """Sender side of one half of a split KV: layers [0, split) (first) or [split, L)."""
        ...

    async def immigrate_partial(self, batch: BatchSpec, first: bool, split: int, src: Sequence[int],
                                dst: Sequence[int]) -> CachedBatch:
        """Receiver side of one half; the second half's answer is the decode-ready batch."""
        ...

    def start_decode(self, batches: Sequence[CachedBatch], last_tokens: Sequence[Sequence[int]],
                     call_id: str = "", after: str = "") -> Coroutine[Any, Any, StepResult]:
        """DecodeV2, sent at the caller's next yield; `after` orders it behind a call still on the wire."""
        ...

    async def filter_batch(self, batch_id: BatchId, keep: Sequence[RequestId]) -> CachedBatch:
        """Keep only `keep`; the replica frees the others' pages."""
        ...

    async def clear_cache(self, batch_id: BatchId | None = None) -> None:
        """Free one batch (or every batch when None)."""
        ...

    async def migrate(self, batch: BatchSpec, src: Sequence[int], dst: Sequence[int]) -> CachedBatch:
        """Sender side of a full KV migration."""
        ...

    async def immigrate(self, batch: BatchSpec, src: Sequence[int], dst: Sequence[int]) -> CachedBatch:
        """Receiver side of a full KV migration: returns the decode-ready batch."""
        ...

    async def send_params(self, dst: int, model: str = "", host_copy: bool = False, share: int = 0,
                          shares: int = 0) -> None:
        """Start a background p2p weight send of `model` (a sender holding another refuses) to
        global rank `dst`; `host_copy`: of the sender's host-memory copy of `model` instead of its
        weight buffer (NOT_FOUND when it holds none); `shares` > 0: only share `share` of them
        (the receiver's RecvParams names every share's source)."""
        ...

    async def recv_params(self, src: int, model: str = "", more_srcs: Sequence[int] = ()) -> None:
        """Start a background p2p weight receive of `model` (recorded as the receiver's model) from
        global rank `src` (and `more_srcs` at once: share i of the regions from source i)."""
        ...

    async def rdma_broadcast(
        self, src_ranks: Sequence[int], dst_ranks: Sequence[int], model: str = ""
    ) -> None:
        """Start this member's part of a chain multicast of `model`'s weights."""
        ...

    async def tanz_broadcast(
        self, src_ranks: Sequence[int], dst_ranks: Sequence[int], model: str = ""
    ) -> None:
        """This member's part of a Tanz broadcast of `model`'s weights (blocks until it is done)."""
        ...

    async def load_params(self, from_host: bool, model: str = "") -> None:
        """Fill the weights from the model root (`model`: a folder under it) or the host-memory copy."""
        ...

    async def wait_rdma_done(self) -> None:
        """Join the background weight transfer; raises its error."""
        ...

    async def reset_status(self) -> None:
        """Mark the weights unloaded."""
        ...

    async def connect_peers(self, peers: Sequence[int], timeout: float) -> list[PeerLink]:
        """Set up the replica's fabric connections with the replicas of global ranks `peers`."""
        ...

    async def close(self) -> None:
        """Release the connection."""
        ...


Connect = Callable[[str], ReplicaApi]
"""Builds the client of the replica at an address (`main.py` passes the gRPC one)."""
