"""A simulated replica's weights: the card's weight layout with every region scaled, and its `WeightIO`.

The buffer keeps the card's regions (`embed | layer 0 | … | head`) in order, each `--byte-scale`
of its real size, so a weight transfer moves (and paces) the scaled bytes region by region, and
readiness rises layer by layer as in the real engine. The card is the checkpoint: LoadParams
"reads" it from any folder under the model root, and its bytes are zeros.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from replica.engine.sim.runner import scaled
from replica.model.layout import Region, WeightLayout


def scaled_layout(full: WeightLayout, scale: float) -> WeightLayout:
    """`full`'s regions, in order and contiguous, each `scale` of its size (at least a byte)."""
    regions: list[Region] = []
    cursor = 0
    for region in full.regions:
        nbytes = scaled(region.nbytes, scale)
        regions.append(Region(region.name, region.kind, region.index, cursor, nbytes, ()))
        cursor += nbytes
    return replace(full, regions=tuple(regions), total_bytes=cursor, alignment=1)


class _HostCopy:
    """The host-memory copy of a simulated replica: only that one exists (its bytes are zeros)."""


class CardIO:
    """`params.store.WeightIO` for a model card: nothing to read, zeros to copy."""

    def has_checkpoint(self, path: Path) -> bool:
        """The card is the checkpoint, wherever LoadParams points under the model root."""
        return True

    def check_layout(self, path: Path, layout: WeightLayout) -> None:
        """Nothing on disk to disagree with the card."""

    def load(self, path: Path, layout: WeightLayout, buffer: Any, landed: Callable[[str], None]) -> None:
        """Every region lands in order (the store paces each at the emulated disk's rate)."""
        for region in layout.regions:
            landed(region.name)

    def empty_copy(self, buffer: Any) -> _HostCopy:
        """A host copy that holds no bytes (they would all be zeros)."""
        return _HostCopy()

    def copy(self, dst: Any, src: Any, lo: int, hi: int) -> None:
        """Zeros onto zeros: nothing to do (the store paces the copy at the host's rate)."""

    def sendable(self, copy: _HostCopy, buffer: Any) -> mmap.mmap:
        """Zeros the size of the weight buffer, made for this send (a copy holds no bytes to register
        on the fabric; the bytes on the wire are what a copy's would be)."""
        return mmap.mmap(-1, len(buffer))
