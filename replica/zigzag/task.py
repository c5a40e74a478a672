"""A layer-level prefill task and its outcome (the engine thread alone touches a task)."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from replica.engine.batch import Batch
from replica.engine.runner import SeqInput
from replica.engine.types import CachedBatchInfo, StepResult
from replica.model.attention import AttentionContext
from replica.params.readiness import Readiness


class OutcomeKind(enum.Enum):
    """How a ZagPrefill ended (the response's `pp_info` encodes it)."""

    FINISHED = "finished"  # every layer and the head ran here: generations valid, pp_info unset
    RELAYED = "relayed"  # handed to a peer after `layers` layers (tfm_layer = layers), activation sent
    RELAYED_UNSTARTED = "relayed_unstarted"  # handed over before any layer (embedding_layer = 1)


@dataclass(frozen=True)
class ZagOutcome:
    """What a ZagPrefill returns."""

    kind: OutcomeKind
    result: StepResult | None = None  # FINISHED only
    batch: CachedBatchInfo | None = None  # the batch kept here (RELAYED*: its first k layers' KV)
    layers: int = 0  # layers run here


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
