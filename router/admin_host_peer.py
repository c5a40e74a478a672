"""The operator's ActivateReplica by `ACTIVATION_METHOD_HOST_PEER`: inactive replicas of one model
load it from other replicas' host-memory copies over the network (SendParams `host_copy_model`, a
share of the regions from each source), as the autoscaler wakes a model at zero (`models.wake_action`).

Sources: the replicas `source_ids` names (any model's; one whose host memory, asked as the move
starts, lacks the model fails it: FAILED_PRECONDITION, the targets inactive again); else up to
`HOST_SOURCES` replicas whose host memory holds it: the model's own other replicas and, with model
pools, the other models' replicas and the spares. Each source is held busy while it sends (no scaling
action, lend or reclaim takes it) and goes on serving its own model.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from router import control
from router.models import HOST_SOURCES, HostCopies
from router.pools import ModelPools, held, holder_of, sendable_copies
from router.replicas import State, TransitionError
from router.types import ReplicaId
from router.weights import Member, Method

if TYPE_CHECKING:
    from router.scheduler import ClusterScheduler

Holder = Callable[[int], "ClusterScheduler"]  # the scheduler holding a replica id (admin._holder)


async def activate_from_host_copies(hub: ClusterScheduler, pools: ModelPools | None,
                                    target_ids: Sequence[int], role: State, source_ids: Sequence[int],
                                    holder: Holder) -> float:
    """Activate `target_ids` (replicas of `hub`'s model) from host copies; returns seconds."""
    if set(source_ids) & set(target_ids):
        raise ValueError("a replica cannot send its host copy to itself")
    model = hub.model_name
    if source_ids:  # each one's host copies are checked as the move starts (`weights._host_peer`)
        addresses = [control.handle_of(holder(i), i).state.address for i in source_ids]
    else:
        addresses = (await _found(hub, pools, model, target_ids))[:HOST_SOURCES]
    if not addresses:
        raise TransitionError(f"no replica's host memory holds {model} (Info host_copies)")
    async with contextlib.AsyncExitStack() as stack:
        peers = [await stack.enter_async_context(_borrow(hub, pools, a)) for a in addresses]
        return await control.activate(hub, target_ids, role, Method.HOST_PEER, peers=peers)


async def _found(hub: ClusterScheduler, pools: ModelPools | None, model: str,
                 target_ids: Sequence[int]) -> list[str]:
    """Every replica that could send `model`'s host copy now (their last Info; the spares' now)."""
    def holding(copies: Sequence[HostCopies]) -> list[str]:
        return sorted(c.address for c in copies if model in c.models)

    own = holding(sendable_copies(hub, {ReplicaId(i) for i in target_ids}))  # the model's own first
    if pools is None:
        return own
    name = next(key for key, sched in pools.schedulers.items() if sched is hub)
    return own + holding(await pools.host_copies(name))


@contextlib.asynccontextmanager
async def _borrow(hub: ClusterScheduler, pools: ModelPools | None, address: str) -> AsyncIterator[Member]:
    """The replica at `address` as a source, held busy in its pool (or out of the spares) meanwhile."""
    if pools is not None:
        async with pools.peer(address) as peer:
            yield peer
        return
    found = holder_of([hub], address)
    if found is None:
        raise TransitionError(f"replica {address} is gone: its host copy cannot be sent")
    async with held(*found) as peer:
        yield peer
