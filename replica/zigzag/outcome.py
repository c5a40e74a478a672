"""What a layer-level prefill answers (ZagPrefill, Relay): plain values, no torch, so the gRPC
front process can decode them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from replica.engine.types import BatchId, CachedBatchInfo, StepResult


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


@dataclass(frozen=True)
class Relayed:
    """What Relay answers: the relayed batch and its sequence number."""

    batch_id: BatchId
    seq: int
