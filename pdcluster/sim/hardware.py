"""What the simulated replicas of one virtual-time run share: the network, meeting points, time.

```
 Hardware ─ network (network.py): each rank's paced links
          ─ meet(key, parties): the two (or more) sides of a transfer find each other, as the real
            ones do on the fabric; the sending side then sets when the transfer ends
          ─ sleep_until(t): virtual time passes
```
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pdcluster.sim.network import Network
from replica.errors import PeerTimeout


def _future() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


@dataclass
class Meeting:
    """The parties of one transfer: when all came, and when the transfer ends (set by its sender)."""

    parties: int
    arrived: int = 0
    all_here: asyncio.Future[None] = field(default_factory=_future)
    end: asyncio.Future[float] = field(default_factory=_future)
    skips: tuple[int, ...] = ()  # a KV migration's receiver: per request, the prompt pages it holds

    async def ended(self, hw: Hardware) -> None:
        """Wait until the transfer's end (virtual time)."""
        try:
            end = await asyncio.wait_for(asyncio.shield(self.end), hw.transfer_timeout)
        except TimeoutError:
            raise PeerTimeout(f"the sender did not start within {hw.transfer_timeout} s") from None
        await hw.sleep_until(end)


class Hardware:
    """The shared parts of a virtual cluster."""

    def __init__(self, network: Network, transfer_timeout: float) -> None:
        self.network = network
        self.transfer_timeout = transfer_timeout
        self.replicas: dict[int, Any] = {}  # rank -> VirtualReplica (set as they are made)
        self._meetings: dict[Hashable, Meeting] = {}

    @staticmethod
    def now() -> float:
        """Virtual seconds."""
        return asyncio.get_running_loop().time()

    async def sleep_until(self, when: float) -> None:
        """Let virtual time reach `when`."""
        delay = when - self.now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def meet(self, key: Hashable, parties: int, skips: tuple[int, ...] = ()) -> Meeting:
        """Wait (up to the transfer timeout) until `parties` callers met on `key` (a KV receiver
        brings the pages it holds already, `skips`, for its sender to leave out)."""
        meeting = self._meetings.get(key)
        if meeting is None:
            meeting = self._meetings[key] = Meeting(parties)
        meeting.arrived += 1
        if skips:
            meeting.skips = skips
        if meeting.arrived == meeting.parties:
            del self._meetings[key]
            meeting.all_here.set_result(None)
        try:
            await asyncio.wait_for(asyncio.shield(meeting.all_here), self.transfer_timeout)
        except TimeoutError:
            if self._meetings.get(key) is meeting:
                del self._meetings[key]
            raise PeerTimeout(
                f"the other side of {key} did not come within {self.transfer_timeout} s") from None
        return meeting
