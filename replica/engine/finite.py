"""Keeping processed logits finite: a stage that overflows saturates instead of breaking sampling.

A penalty or a temperature can push finite logits past the dtype's range (a repetition penalty of
1e-38 divides a positive logit into +inf, a temperature of 1e-5 multiplies 1e34 into +inf), and
+inf - +inf inside a softmax is NaN: the draw then fails the whole batch ("probability tensor
contains either `inf`, `nan` or element < 0"). `saturate` clamps what a stage computed to the
largest finite values of the dtype, except where the stage's input was already -inf: a token a
grammar mask, top-k or top-p removed stays removed. With finite-or--inf inputs every stage of
`sampling` / `device_sampling` (bias, CTRL repetition, frequency / presence, temperature) gives
finite-or--inf outputs after it, never NaN, and a row keeps at least one finite logit.
"""

from __future__ import annotations

import torch


def saturate(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """`new` (a stage's output) within the finite range of its dtype where `old` (its input) was not -inf."""
    top = torch.finfo(new.dtype).max
    return torch.where(old == float("-inf"), old, new.clamp(-top, top))
