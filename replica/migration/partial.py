"""ImmigratePartial: two senders fill one receiver batch, layers [0, k) (FIRST) and [k, L) (SECOND).

```
 FIRST  (from A): admit → slot ─ receive [0, k) ─ outcome ─ wait until SECOND claimed the slot ─► info
 SECOND (from B):     wait for the slot ─ claim ─ receive [k, L) ─ wait for FIRST's outcome ─ adopt ─► info
```
The halves run concurrently (different peers, different streams). Exactly one side cleans up, decided
under the slot's lock: SECOND adopts the batch (both halves received) or frees it (either failed)
once it has seen FIRST's outcome; FIRST frees it if SECOND never claimed the slot before FIRST's
deadline, or if SECOND gave up waiting for FIRST (then FIRST may still have been writing its pages).
SECOND's response is the decode-ready batch; FIRST's names the same batch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from replica.engine.batch import Batch
from replica.engine.types import BatchId, BatchSpec, ImmigratedBatch
from replica.errors import InvalidArgument, PeerTimeout, PeerUnavailable
from replica.migration.manager import Migrations
from replica.migration.plan import LayerHalf, layer_range
from transfer.core import Deadline


@dataclass
class _Slot:
    """One batch being filled by two halves."""

    batch: Batch
    first_ok: bool | None = None  # None while FIRST still receives
    claimed: bool = False  # SECOND took the slot
    abandoned: bool = False  # SECOND gave up waiting for FIRST: FIRST cleans up


class PartialImmigrations:
    """The receiver side of MigratePartial (both halves); thread-safe."""

    def __init__(self, migrations: Migrations) -> None:
        self.m = migrations
        self._slots: dict[BatchId, _Slot] = {}
        self._cond = threading.Condition()

    def _wait(self, deadline: Deadline) -> bool:
        """(Holding the lock) wait a little; False once the deadline passed."""
        left = deadline.remaining()
        if left <= 0:
            return False
        self._cond.wait(min(left, 0.5))
        return True

    # ------------------------------------------------------------------------------ FIRST
    def first(
        self,
        spec: BatchSpec,
        peer: int,
        split: int,
        call_remaining: float | None,
        cancelled: threading.Event | None = None,
    ) -> ImmigratedBatch:
        """Create the batch, receive layers [0, split) from `peer`, hand the batch to SECOND."""
        m = self.m
        m.check_group()
        m.check_peer(peer)
        layers = layer_range(LayerHalf.FIRST, split, m.engine.runner.num_layers)
        deadline = m.deadline(call_remaining)
        batch = m.on_engine(lambda: m.admit(spec), deadline, undo=m.drop_incoming)
        slot = _Slot(batch)
        with self._cond:
            self._slots[batch.id] = slot
            self._cond.notify_all()
        error: Exception | None = None
        try:
            m.receive(batch, peer, layers, deadline, cancelled)
        except Exception as exc:
            error = exc
        with self._cond:
            slot.first_ok = error is None
            self._cond.notify_all()
            while not slot.claimed and self._wait(deadline):
                pass
            mine = slot.abandoned or not slot.claimed
            if not slot.claimed:
                self._slots.pop(batch.id, None)  # too late for SECOND now
        if mine:
            m.later(lambda: m.drop_incoming(batch))
        if error is not None:
            raise error
        if not slot.claimed:
            raise PeerTimeout(f"batch {batch.id}: the SECOND half never came for layers [{split}, L)")
        info = batch.info(m.engine.block_size)
        return ImmigratedBatch(info, tuple(r.cached_tokens for r in batch))

    # ----------------------------------------------------------------------------- SECOND
    def second(
        self,
        spec: BatchSpec,
        peer: int,
        split: int,
        call_remaining: float | None,
        cancelled: threading.Event | None = None,
    ) -> ImmigratedBatch:
        """Wait for FIRST's batch, receive layers [split, L) into it from `peer`, adopt it."""
        m = self.m
        m.check_group()
        m.check_peer(peer)
        layers = layer_range(LayerHalf.SECOND, split, m.engine.runner.num_layers)
        deadline = m.deadline(call_remaining)
        slot = self._claim(spec, deadline, cancelled)
        error: Exception | None = None
        try:
            m.receive(slot.batch, peer, layers, deadline, cancelled)
        except Exception as exc:
            error = exc
        with self._cond:
            while slot.first_ok is None and self._wait(deadline):
                pass
            if slot.first_ok is None:
                slot.abandoned = True  # FIRST may still write its pages: it frees them when done
                raise error or PeerTimeout(f"batch {spec.id}: the FIRST half did not finish in time")
            self._slots.pop(spec.id, None)
        if error is not None or not slot.first_ok:
            m.later(lambda: m.drop_incoming(slot.batch))
            raise error or PeerUnavailable(f"batch {spec.id}: the FIRST half (layers [0, {split})) failed")
        return m.on_engine(lambda: m.adopt(slot.batch), deadline, undo=m._clear_adopted)

    def _claim(self, spec: BatchSpec, deadline: Deadline, cancelled: threading.Event | None) -> _Slot:
        with self._cond:
            while (slot := self._slots.get(spec.id)) is None or slot.claimed:
                if cancelled is not None and cancelled.is_set():
                    raise PeerUnavailable(f"batch {spec.id}: the caller cancelled while waiting for FIRST")
                if not self._wait(deadline):
                    raise PeerTimeout(f"batch {spec.id}: no FIRST half to complete before the deadline")
            wanted = tuple(r.id for r in spec.requests)
            if slot.batch.request_ids != wanted:
                got = list(slot.batch.request_ids)
                raise InvalidArgument(f"batch {spec.id}: FIRST brought requests {got}, not {list(wanted)}")
            slot.claimed = True
            self._cond.notify_all()
            return slot
