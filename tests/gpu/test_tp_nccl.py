"""A tensor-parallel group over NCCL (one process per GPU): tp 2 greedy tokens equal transformers'
(float32) for Llama with KV heads >= tp and Mistral with one KV head shared by both ranks.
Skips with fewer than two CUDA devices."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.tp_reference import reference_tokens, run_leader

REASON = "tensor parallelism over NCCL needs at least two CUDA devices"
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason=REASON)

CASES = {
    "llama-kv2": {"arch": "llama", "seed": 31},
    "mistral-window-kv1": {"arch": "mistral", "kv_heads": 1, "sliding_window": 6, "seed": 32},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_over_nccl_equals_transformers(tiny_model_factory: Callable[..., Path], name: str) -> None:
    model = tiny_model_factory(**CASES[name])
    result = run_leader(model, 2, "--device", "cuda:0")
    assert result == {"tokens": reference_tokens(model), "refused": "InvalidArgument"}
