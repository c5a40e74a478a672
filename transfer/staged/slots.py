"""Staging slots: the host memory a lane ((peer, stream, direction)) stages device bytes through.

A lane holds at most `depth` slots, each as big as the biggest message it carried (messages are
`chunk_bytes` pieces, so slots settle at that size and are recycled, never grown again). Several
slots per lane are the double buffering: one slot's bytes are on the socket while the next slot's
device copy runs. All lanes together stay within `StagingBudget.max_bytes`, except that a lane with
no slot in use may always take one: every lane can make progress, so no lane waits on another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transfer.staged.device import HostSlot


@dataclass
class StagingBudget:
    """Host staging bytes allocated by all lanes of one fabric, and their ceiling."""

    max_bytes: int
    allocated: int = 0

    def allows(self, extra: int, must: bool) -> bool:
        """Whether `extra` more bytes may be allocated (`must`: the lane has nothing in use)."""
        return must or self.allocated + extra <= self.max_bytes


@dataclass(eq=False)
class Slot:
    """One staging slot, registered in the inner fabric as `name`."""

    name: str
    host: HostSlot | None = None
    busy: bool = False

    @property
    def capacity(self) -> int:
        return 0 if self.host is None else self.host.view.nbytes


class SlotPool:
    """The slots of one lane; used under the fabric's lock."""

    def __init__(self, prefix: str, depth: int, budget: StagingBudget,
                 allocate: Callable[[int], HostSlot], install: Callable[[Slot], None]) -> None:
        if depth < 1:
            raise ValueError(f"a lane needs at least one staging slot, got depth {depth}")
        self.prefix, self.depth, self.budget = prefix, depth, budget
        self._allocate, self._install = allocate, install
        self.slots: list[Slot] = []

    def in_use(self) -> int:
        """Slots holding a message now."""
        return sum(slot.busy for slot in self.slots)

    def acquire(self, nbytes: int) -> Slot | None:
        """A free slot of at least `nbytes` (reused, grown or new), or None: wait for a release."""
        free = [slot for slot in self.slots if not slot.busy]
        fitting = [slot for slot in free if slot.capacity >= nbytes]
        must = self.in_use() == 0
        largest = max(free, key=lambda s: s.capacity, default=None)
        if fitting:
            slot = min(fitting, key=lambda s: s.capacity)
        elif largest is not None and self.budget.allows(nbytes - largest.capacity, must):
            slot = largest
            self._fill(slot, nbytes)
        elif len(self.slots) < self.depth and self.budget.allows(nbytes, must):
            slot = Slot(f"{self.prefix}:{len(self.slots)}")
            self.slots.append(slot)
            self._fill(slot, nbytes)
        else:
            return None
        slot.busy = True
        return slot

    def release(self, slot: Slot) -> None:
        """Give `slot` back to the lane."""
        slot.busy = False

    def _fill(self, slot: Slot, nbytes: int) -> None:
        self.budget.allocated += nbytes - slot.capacity
        slot.host = self._allocate(nbytes)
        self._install(slot)

    def allocated(self) -> int:
        """Bytes held by this lane's slots."""
        return sum(slot.capacity for slot in self.slots)
