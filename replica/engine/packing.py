"""Packed float32 CPU weights for a loaded model, kept only while its weights are complete.

`replica.model.linear.pack` copies each linear weight into oneDNN's blocked layout once (same
results, faster calls; the plain buffer stays the model, for transfers and for layers still
arriving). A copy is right only while the plain bytes are those it was made from: every write to the
buffer starts with `ParamReadiness.reset` (`ParamStore.begin_fill`), so `track` drops the packs on
any change that leaves the weights incomplete and packs again once every region has landed.
"""

from __future__ import annotations

import logging

import torch

from replica.model import linear
from replica.model.llama import CausalLM, Projection
from replica.params.readiness import Listener, ParamReadiness, Readiness

log = logging.getLogger(__name__)


def linear_pairs(model: CausalLM) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every (weight, bias) the model's forward passes to `linear` (projections and the LM head)."""
    pairs = [pair for m in model.modules() if isinstance(m, Projection) for pair in m._pairs]
    return [*pairs, (model.lm_head, None)]


def linear_weights(model: CausalLM) -> list[torch.Tensor]:
    """Every matrix the model's forward passes to `linear` (projections and the LM head)."""
    return [w for w, _ in linear_pairs(model)]


def track(model: CausalLM, readiness: ParamReadiness) -> Listener | None:
    """Pack `model`'s weights now if complete, and follow `readiness` from now on; returns the
    listener (a model switch unsubscribes it), None when nothing is packable."""
    pairs = linear_pairs(model)
    weights = [w for w, _ in pairs]
    if not any(linear.packable(w) for w in weights):
        return None  # another device or dtype: nothing to pack, nothing to follow

    def follow(state: Readiness) -> None:
        if not state.complete:
            linear.unpack(weights)
        elif not linear.is_packed(weights[0]):
            log.info("packed linear weights: %.1f MB", linear.pack(weights) / 1e6)
            # oneDNN's kernels for the packed weights at every row bucket, before they serve
            log.info("oneDNN warmed: %d calls", linear.warm(pairs))

    follow(readiness.snapshot())
    readiness.subscribe(follow)
    return follow
