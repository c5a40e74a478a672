"""`LocalCore`: the edge and the core in one process (`--no-grpc-frontend`, and in-process tests).

```
 gRPC thread ── ENGINE call ──► worker.submit(core.engine_work) ──► engine thread runs it,
     ▲                                                               its future delivers the outcome
     └──────────────────────── waits on the Pending ◄────────────────┘
 gRPC thread ── SERVICE call ──► core.run(call, CallContext) on the gRPC thread itself
```
Giving up: an ENGINE call not started yet is skipped (its future cancelled), one that is running
finishes and its result goes to the call's `orphan`; a SERVICE call's context is cancelled (its
waits stop, its senders abort), and its `after` callbacks run once the RPC is over.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from replica.engine.worker import WorkItem
from replica.server.calls import CallContext
from replica.server.client import CoreClient, Pending
from replica.server.core import ReplicaCore, as_replica_error
from replica.server.messages import Call, Lane


class LocalCore(CoreClient):
    """Calls the core in this process."""

    def __init__(self, core: ReplicaCore) -> None:
        super().__init__()
        self.core = core

    def start(self, call: Call, deadline: float | None) -> Pending:
        if call.lane is not Lane.ENGINE:
            return Pending(call, CallContext(deadline))  # runs in `wait`, on the caller's thread
        item = self.core.worker.submit(self.core.engine_work(call, deadline))
        pending = Pending(call, item)
        item.future.add_done_callback(lambda future: self._settle(pending, future))
        return pending

    def wait(self, pending: Pending, timeout: float | None) -> Any:
        ctx = pending.handle
        if isinstance(ctx, CallContext):
            try:
                self.deliver(pending, True, self.core.run(pending.call, ctx))
            except BaseException as exc:
                self.deliver(pending, False, as_replica_error(exc))
        return super().wait(pending, timeout)

    def _settle(self, pending: Pending, future: Future[Any]) -> None:
        if future.cancelled():
            return  # given up before it started: settled already
        exc = future.exception()
        if exc is None:
            self.deliver(pending, True, future.result())
        else:
            self.deliver(pending, False, as_replica_error(exc))

    def _abandon(self, pending: Pending) -> None:
        handle = pending.handle
        if isinstance(handle, WorkItem):
            handle.future.cancel()  # only if it has not started; a running one ends normally
        elif isinstance(handle, CallContext):
            handle.cancel()

    def _finished(self, pending: Pending) -> None:
        if isinstance(pending.handle, CallContext):
            pending.handle.finish()
