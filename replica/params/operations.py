"""`ParamOps`: at most one parameter operation at a time, in the background or blocking.

```
 SendParams / RecvParams / RdmaBroadcast ─► start_background ─► thread runs the transfer
                                                                   │ error kept
 WaitRdmaDone ─────────────────────────► wait (call deadline) ◄────┘ join, return its error
 NvlBroadcast / TanzBroadcast / LoadParams ─► run_blocking (the guard for the call's length)
 ResetStatus / SetStatusReady ─► refused while the guard is held
```

The guard is taken when an operation starts and released when a blocking one returns, or when
WaitRdmaDone joins a background one (as in the reference: a finished background transfer still
holds the guard until it is joined). A second operation while the guard is held is
FAILED_PRECONDITION; so is WaitRdmaDone when no background operation was started (the call is out
of order, not malformed). Transfers touch only the registered weight buffer and the thread-safe
readiness, never engine state, so they run off the engine thread.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

from replica.errors import DeadlineExceeded, FailedPrecondition, ReplicaError

log = logging.getLogger(__name__)


class OpState(enum.Enum):
    """Where the parameter guard is."""

    IDLE = "idle"
    BACKGROUND = "background"  # a background operation runs or waits to be joined
    BLOCKING = "blocking"  # a blocking operation runs on its caller's thread


class ParamOps:
    """The parameter-operation guard and the background operation, if any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = OpState.IDLE
        self._name = ""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def state(self) -> OpState:
        """IDLE, BACKGROUND or BLOCKING."""
        with self._lock:
            return self._state

    @property
    def busy(self) -> bool:
        """Whether a parameter operation holds the guard."""
        return self.state is not OpState.IDLE

    def _acquire(self, name: str, state: OpState) -> None:
        with self._lock:
            if self._state is not OpState.IDLE:
                raise FailedPrecondition(f"{name}: another parameter operation ({self._name}) is in flight")
            self._state, self._name, self._error = state, name, None

    def _release(self) -> None:
        with self._lock:
            self._state, self._name, self._thread = OpState.IDLE, "", None

    def start_background(self, name: str, prepare: Callable[[], None], run: Callable[[], None]) -> None:
        """Take the guard, run `prepare` now (its error is the caller's), then `run` on a thread."""
        self._acquire(name, OpState.BACKGROUND)
        try:
            prepare()
        except BaseException:
            self._release()
            raise
        thread = threading.Thread(
            target=self._background, args=(name, run), name=f"params-{name}", daemon=True
        )
        with self._lock:
            self._thread = thread
        thread.start()

    def _background(self, name: str, run: Callable[[], None]) -> None:
        try:
            run()
            log.info("%s finished", name)
        except BaseException as exc:  # kept for WaitRdmaDone, which re-raises it
            log.warning("%s failed: %s", name, exc)
            with self._lock:
                self._error = exc

    def wait(self, timeout: float | None) -> None:
        """WaitRdmaDone: join the background operation; raise its error; release the guard."""
        with self._lock:
            thread, state = self._thread, self._state
        if state is not OpState.BACKGROUND or thread is None:
            raise FailedPrecondition("WaitRdmaDone: no background parameter operation was started")
        thread.join(timeout)
        if thread.is_alive():
            raise DeadlineExceeded(f"the background parameter operation did not finish within {timeout} s")
        with self._lock:
            error = self._error
        self._release()
        if error is not None:
            raise error if isinstance(error, ReplicaError) else ReplicaError(str(error))

    def run_blocking(self, name: str, fn: Callable[[], None]) -> None:
        """Hold the guard while `fn` runs on the caller's thread."""
        self._acquire(name, OpState.BLOCKING)
        try:
            fn()
        finally:
            self._release()

    def require_idle(self, what: str) -> None:
        """Refuse `what` while a parameter operation holds the guard."""
        with self._lock:
            if self._state is not OpState.IDLE:
                raise FailedPrecondition(f"{what}: a parameter operation ({self._name}) is in flight")
