"""`CoreClient`: how the gRPC edge calls the core, whatever the placement (`local.py`, `remote.py`).

```
 edge handler: start(call, deadline) ──► Pending ── wait(pending, timeout) ──► value | ReplicaError
               RPC over (grpc callback) ──► ended(pending): answered → finished(); else give_up()
 outcome arrives (engine thread / reply reader) ──► deliver(pending, ok, value)
               caller already gone and it succeeded ──► call.orphan(value) started, unwatched
```
Every call is settled exactly once: by its outcome, by its caller giving up (deadline, cancel),
or by the connection closing. A result that comes after its caller gave up is handed to the
call's `orphan` (a prefill's batch is cleared), the same way in both placements.
"""

from __future__ import annotations

import abc
import threading
from typing import Any

from replica.errors import DeadlineExceeded, ReplicaError
from replica.server.messages import Call


class Pending:
    """One call the edge waits for.

    `done` is a raw lock, held from the start and released exactly once (under the client's lock:
    by the outcome, the caller giving up, or the connection closing); the caller waits by acquiring
    it. A C-level acquire / release costs a fraction of a `threading.Event` (a Python Condition).
    """

    __slots__ = ("call", "done", "gone", "handle", "outcome")

    def __init__(self, call: Call, handle: Any = None) -> None:
        self.call = call
        self.handle = handle  # the placement's own: a work item, a CallContext, a call id
        self.done = threading.Lock()
        self.done.acquire()
        self.outcome: tuple[bool, Any] | None = None  # (True, value) or (False, ReplicaError)
        self.gone = False  # the caller gave up: a late outcome is for nobody


class CoreClient(abc.ABC):
    """Starts calls on the core and settles them; subclasses carry them (`start`, `_abandon`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @abc.abstractmethod
    def start(self, call: Call, deadline: float | None) -> Pending:
        """Hand `call` to the core; two starts reach the engine in the order they were made.

        `deadline` is a `time.monotonic()` value (None: none); a call not started by then is not run.
        """

    @abc.abstractmethod
    def _abandon(self, pending: Pending) -> None:
        """The caller gave up before the outcome: tell the core, if that changes anything there."""

    def _finished(self, pending: Pending) -> None:
        """The answer of `pending` went out (the core may run what it put off until then)."""
        del pending

    def _value(self, pending: Pending, value: Any) -> Any:
        """An outcome's value as the call's reply type (a remote one arrives encoded)."""
        del pending
        return value

    def wait(self, pending: Pending, timeout: float | None) -> Any:
        """The call's reply within `timeout` s (DeadlineExceeded after, and the call is given up)."""
        if not pending.done.acquire(True, -1 if timeout is None else timeout):
            self.give_up(pending)
        outcome = pending.outcome
        if outcome is None:
            raise DeadlineExceeded(f"the replica did not finish within the call's deadline ({timeout} s)")
        ok, value = outcome
        if not ok:
            raise value
        return self._value(pending, value)

    def ended(self, pending: Pending) -> None:
        """The RPC is over: its answer went out, or its caller is gone."""
        with self._lock:
            answered = pending.outcome is not None
        if answered:
            self._finished(pending)
        else:
            self.give_up(pending)

    def give_up(self, pending: Pending) -> None:
        """Nobody will take the call's outcome any more."""
        with self._lock:
            if pending.outcome is not None or pending.gone:
                return
            pending.gone = True
            pending.done.release()
        self._abandon(pending)

    def deliver(self, pending: Pending, ok: bool, value: Any) -> None:
        """The call's outcome (`ok`: its reply; else a ReplicaError), from whichever thread has it."""
        with self._lock:
            gone = pending.gone
            if not gone:
                pending.outcome = (ok, value)
                pending.done.release()
        if gone and ok:
            self.discard(pending.call, self._value(pending, value))

    def discard(self, call: Call, reply: Any) -> None:
        """`reply` will reach nobody: start what undoes it, not waiting for it."""
        undo = call.orphan(reply)
        if undo is None:
            return
        pending = self.start(undo, None)
        with self._lock:
            pending.gone = True  # its own outcome is for nobody

    def fail_all(self, pendings: list[Pending], error: ReplicaError) -> None:
        """The connection to the core closed: every call still waiting fails with `error`."""
        for pending in pendings:
            self.deliver(pending, False, error)
