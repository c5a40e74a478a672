"""`CheckpointIO`: the torch engine's weight bytes — a Hugging Face checkpoint on disk, tensor copies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from replica.errors import FailedPrecondition
from replica.model.config import ModelConfig
from replica.model.layout import WeightLayout
from replica.model.weights import load_weights


class CheckpointIO:
    """Reads a checkpoint folder into the flat uint8 weight tensor; copies it for the host cache."""

    def has_checkpoint(self, path: Path) -> bool:
        """A checkpoint folder (its config.json) is there."""
        return (path / "config.json").is_file()

    def check_layout(self, path: Path, layout: WeightLayout) -> None:
        """FAILED_PRECONDITION unless the checkpoint at `path` lays out exactly like `layout`."""
        other = WeightLayout.for_config(ModelConfig.from_dir(path), layout.dtype, layout.shard)
        if other.signature() != layout.signature():
            raise FailedPrecondition(f"the checkpoint at {path} has a different weight layout")

    def load(self, path: Path, layout: WeightLayout, buffer: torch.Tensor,
             landed: Callable[[str], None]) -> None:
        """Fill `buffer` from the checkpoint, `landed(region name)` as each region completes."""
        load_weights(path, layout, buffer, landed)

    def empty_copy(self, buffer: torch.Tensor) -> torch.Tensor:
        """A host buffer the size of `buffer`: pinned host memory for a device buffer (the host cache
        is host memory, not a second device buffer; pinned so copies to the device run at full speed)."""
        return torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=buffer.device.type == "cuda")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
        """Bytes [lo, hi) of `src` into `dst`."""
        dst[lo:hi].copy_(src[lo:hi])

    def sendable(self, copy: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """The copy itself (host memory: every fabric that moves host buffers registers it)."""
        return copy
