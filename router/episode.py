"""A new replica's layer-by-layer prefills, as the router tracks them (live scaling; see zigzag.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from router.batches import Member
from router.types import BatchId, RequestId, ZagOutcome

# The ramp of outstanding layer-by-layer prefills on one new replica: `ZAG_START` at first, one
# fewer every `ZAG_STEP_S` seconds of loading, never below `ZAG_MIN` (the reference system's values).
ZAG_START, ZAG_MIN, ZAG_STEP_S = 4, 2, 0.2


@dataclass
class ZagTask:
    """One layer-by-layer prefill on a new replica, as the router tracks it."""

    seq: int
    batch_id: BatchId
    members: list[Member]
    pages: dict[RequestId, int]
    call: asyncio.Task[ZagOutcome]
    taken: bool = False  # an old replica relayed it: its outcome is handled there


@dataclass
class Episode:
    """The zigzag prefills of one new replica, from its live load to its last relay."""

    started: float
    next_seq: int = 0
    tasks: list[ZagTask] = field(default_factory=list)
    embed_checked: float = float("-inf")
    embed_ready: bool = False

    def limit(self, now: float) -> int:
        """Outstanding prefills allowed now (the ramp)."""
        return max(ZAG_MIN, ZAG_START - int((now - self.started) / ZAG_STEP_S))

    def open_tasks(self) -> list[ZagTask]:
        """Tasks no old replica took yet."""
        return [t for t in self.tasks if not t.taken]

    def task(self, batch_id: BatchId) -> ZagTask | None:
        """The task of a batch."""
        return next((t for t in self.tasks if t.batch_id == batch_id), None)
