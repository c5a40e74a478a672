"""`PeerLinks`: a joining replica's fabric connections are made when it joins, off every critical path.

```
 add_replica(R) / R revived ──► joined(R, others) ──► task: ConnectPeers(others' ranks) on R
                                                          ‖  ConnectPeers([R's rank]) on each other
                                                          └► timeline "links" + one log line
```
Both ends are asked at once (NCCL pairs ranks: both must set up the edge). The calls run in the
background under `--peer-connect-timeout`: a scale-up that activates R later finds its weights and
KV connections up. A replica that does not implement ConnectPeers, or one that fails it, is only
logged: its transfers connect on first use, as they always could.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from router.errors import ReplicaCallError, ReplicaUnimplemented
from router.registry import ReplicaHandle
from router.types import PeerLink

log = logging.getLogger(__name__)


class PeerLinks:
    """Background ConnectPeers calls, one task per join; `stop` cancels them."""

    def __init__(self, timeout: float, record: Callable[..., None]) -> None:
        self.timeout = timeout  # 0: connections are made on first use
        self._record = record  # the timeline's writer (kind, **fields)
        self._tasks: set[asyncio.Task[None]] = set()

    def joined(self, handle: ReplicaHandle, others: Sequence[ReplicaHandle]) -> None:
        """`handle` joined (or came back); `others` are the live replicas it may exchange with."""
        others = [h for h in others if h is not handle]
        if self.timeout <= 0 or not others:
            return
        task = asyncio.create_task(self._link(handle, others), name=f"links-{handle.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _link(self, handle: ReplicaHandle, others: Sequence[ReplicaHandle]) -> None:
        rank = handle.state.info.rank
        calls = [handle.client.connect_peers([o.state.info.rank for o in others], self.timeout)]
        calls += [o.client.connect_peers([rank], self.timeout) for o in others]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [_failure(h.state.address, r) for h, r in zip([handle, *others], results, strict=True)]
        failed = [f for f in failed if f]
        links = [link for r in results if isinstance(r, list) for link in r]
        slowest = max((link.connect_ms for link in links), default=0.0)
        self._record("links", replica=handle.id, rank=rank, peers=len(others), failed=failed,
                     slowest_ms=round(slowest, 3))
        if failed:
            log.warning("replica %s: fabric connections not all made ahead (they connect on first use): %s",
                        handle.id, "; ".join(failed))
        else:
            log.info("replica %s: fabric connections with %d replicas up (slowest %.1f ms)", handle.id,
                     len(others), slowest)

    async def stop(self) -> None:
        """Cancel the calls still running."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)


def _failure(address: str, result: Any) -> str:
    """What went wrong with one replica's ConnectPeers ("" when every link is up)."""
    if isinstance(result, ReplicaUnimplemented):
        return f"{address}: does not implement ConnectPeers"
    if isinstance(result, ReplicaCallError):
        return f"{address}: {result.code}: {result.details}"
    if isinstance(result, BaseException):
        return f"{address}: {type(result).__name__}: {result}"
    broken = [f"rank {link.rank}: {link.error}" for link in result
              if isinstance(link, PeerLink) and link.error]
    return f"{address}: {', '.join(broken)}" if broken else ""
