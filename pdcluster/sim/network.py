"""The links of a virtual-time cluster: each rank's NICs as FIFO pacers, as the tcp fabric paces them.

```
 rank r ─ inter-node NIC (its node's `nic_gbps`) ─► ranks on other nodes
        ─ intra-node link (`intra_gbps`) ────────► ranks on its node        (0 Gbit/s: no limit)
 a transfer of n bytes from r: starts when r's link is free, takes n / rate, holds the link meanwhile
 a layer-by-layer transfer (progressive KV): each layer's bytes go once the forward made them
```
As in the real fabric the sender's egress is paced, one transfer after another per link; the
receiver is not. Rates are full-scale (the virtual cluster moves the card's real bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Link:
    """One paced egress link: bytes/s (0 = unlimited) and when it is free again."""

    rate: float
    free_at: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """Time `nbytes` take on this link alone."""
        return 0.0 if self.rate <= 0 else nbytes / self.rate

    def reserve(self, now: float, nbytes: float) -> tuple[float, float]:
        """Queue `nbytes` behind what the link already carries: (start, end)."""
        start = max(now, self.free_at)
        end = start + self.seconds(nbytes)
        self.free_at = end
        return start, end


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits and what its links carry (Gbit/s; 0 = unlimited)."""

    node: str
    nic_gbps: float = 0.0
    intra_gbps: float = 0.0
    host_models: tuple[str, ...] = ()  # models its node's host memory holds at start


class Network:
    """Every rank's links."""

    def __init__(self, places: Sequence[RankPlace]) -> None:
        self.places = list(places)
        self.inter = [Link(p.nic_gbps * 1e9 / 8) for p in places]
        self.intra = [Link(p.intra_gbps * 1e9 / 8) for p in places]

    def link(self, src: int, dst: int) -> Link:
        """The link `src` sends to `dst` on."""
        same = self.places[src].node == self.places[dst].node
        return self.intra[src] if same else self.inter[src]

    def send(self, src: int, dst: int, nbytes: float, now: float) -> float:
        """Queue a transfer; returns when its last byte has left (and arrived)."""
        return self.link(src, dst).reserve(now, nbytes)[1]

    def send_as_made(self, src: int, dst: int, nbytes: float, made_from: float, made_by: float,
                     pieces: int) -> float:
        """Queue a transfer made in `pieces` equal parts at an even pace from `made_from` to
        `made_by` (a forward's layers), each sent once made and after the one before it; returns
        when the last byte has left (and arrived)."""
        link = self.link(src, dst)
        pieces = max(1, pieces)
        each, pace = link.seconds(nbytes / pieces), (made_by - made_from) / pieces
        end = link.free_at
        for i in range(1, pieces + 1):
            end = max(end, made_from + i * pace) + each
        link.free_at = end
        return end
