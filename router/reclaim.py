"""Taking a replica from another model for a wake when no spare is left (several models).

```
 ModelPools.reclaim(name) ─► models.reclaim_order over every other model's replicas
     idle (keep-alive) ─────────────────────────────► Expire (ResetStatus) ─► release to the spares
     serving, its model quiet ─► Drain ─► idle once empty (≤ DRAIN_WAIT_S) ─► Expire ─► release
```
A replica's weights stay in its host memory (ResetStatus keeps them, within `--host-cache-bytes`),
so the model it served can be woken from there again, here or over the network. Every step runs as
that model's own scaling action (marked busy, on its timeline); a step that fails leaves the replica
to its model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from router.models import Held
from router.registry import ReplicaHandle
from router.replicas import State
from router.scaling.actions import Drain, Expire
from router.scheduler import ClusterScheduler
from router.types import ReplicaId

log = logging.getLogger("pdcluster.router")
DRAIN_WAIT_S = 2.0  # how long a drained quiet replica may take to become idle
POLL_S = 0.01


def held_by(name: str, sched: ClusterScheduler, fronting: int) -> list[Held]:
    """Model `name`'s replicas as `models.reclaim_order` sees them (`fronting`: its requests waiting
    at the front for a wake). A serving replica counts as quiet only when its model has no work and
    keeps its minimum of that kind without it (`--min-prefill`, `--min-decode`: an operator's floor
    is never reclaimed)."""
    scaling = sched.scaling
    quiet = (not sched.queued()[0] and not fronting and not scaling.tasks
             and all(h.empty for h in sched.replicas.values()))
    arrivals = scaling.rates.arrivals.rate(sched.clock())
    live = [h for h in sched.replicas.values() if h.state.alive]
    return [Held(name, h.id, h.state.role, h.state.since, quiet and _above_floor(sched, live, h.state.role),
                 arrivals)
            for h in live if h.id not in scaling.executor.busy]


def _above_floor(sched: ClusterScheduler, live: list[ReplicaHandle], role: State) -> bool:
    """One replica of `role` fewer keeps the model at its bounds' minimum."""
    bounds = sched.scaling.bounds
    prefill = sum(1 for h in live if h.state.role in (State.PREFILL, State.COLOCATED))
    decode = sum(1 for h in live if h.state.role in (State.DECODE, State.COLOCATED))
    if role is State.PREFILL:
        return prefill > bounds.min_prefill
    if role is State.DECODE:
        return decode > bounds.min_decode
    return role is not State.COLOCATED or (prefill > bounds.min_prefill and decode > bounds.min_decode)


async def take_back(sched: ClusterScheduler, held: Held) -> bool:
    """Drain `held` (when it serves) until idle, then Expire it: True once it is inactive."""
    executor = sched.scaling.executor
    if held.state is not State.IDLE:
        if not await executor.run(Drain(held.replica)):
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN_WAIT_S):
                while _role(sched, held.replica) is not State.IDLE:
                    await asyncio.sleep(POLL_S)
        if _role(sched, held.replica) is not State.IDLE:
            log.info("model %s: replica %s did not become idle for a reclaim", held.model, held.replica)
            return False
    return await executor.run(Expire(held.replica))


def _role(sched: ClusterScheduler, rid: ReplicaId) -> State | None:
    handle = sched.replicas.get(rid)
    return handle.state.role if handle is not None else None
