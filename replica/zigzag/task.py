"""A layer-level prefill task (the engine thread alone touches a task); its outcome is in `outcome.py`."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from replica.engine.batch import Batch
from replica.engine.runner import SeqInput
from replica.model.attention import AttentionContext
from replica.params.readiness import Readiness
from replica.zigzag.outcome import ZagOutcome


@dataclass(eq=False)
class ZagTask:
    """One batch advancing layer by layer: not started (`layer` = -1), after embedding, ..., all layers."""

    seq: int
    batch: Batch
    start_ns: int
    future: Future[ZagOutcome] = field(default_factory=Future)
    seqs: list[SeqInput] = field(default_factory=list)
    ctx: AttentionContext | None = None
    hidden: torch.Tensor | None = None  # (tokens, hidden) activation after `layer` layers
    layer: int = -1
    forward_ns: int = 0

    @property
    def started(self) -> bool:
        """Whether the embedding ran."""
        return self.layer >= 0

    def can_advance(self, ready: Readiness) -> bool:
        """Whether its next step (embed, next layer, or head) has its weights in place."""
        if not self.started:
            return ready.embed
        if self.layer < ready.num_layers:
            return ready.layers > self.layer
        return ready.head

    @property
    def layers_done(self) -> int:
        """Transformer layers run so far."""
        return max(self.layer, 0)
