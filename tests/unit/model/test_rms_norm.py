"""RMSNorm gives transformers' LlamaRMSNorm bits in every weight dtype (and F.rms_norm's in float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from replica.model.llama import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e3])
def test_rms_norm_matches_transformers_bit_for_bit(dtype: torch.dtype, scale: float) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 96, generator=g) * scale).to(dtype)
    weight = torch.randn(96, generator=g).to(dtype)
    ours = RMSNorm(weight, 1e-6)
    theirs = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
        if dtype == torch.float32:
            assert torch.equal(ours(x), F.rms_norm(x, (96,), weight, 1e-6))
