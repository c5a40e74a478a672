"""Tensor-parallel groups on the CPU (gloo, one process per rank) against transformers.

Rank 0 runs in a helper process (`tests.helpers.tp_greedy`) that starts the other ranks, feeds a
prompt in two resumed chunks over scattered pages and decodes greedily; its tokens must equal
transformers' greedy `generate` (float32) on the same tiny checkpoint. Variants cover Llama, Mistral
(sliding window) and Qwen2 (q/k/v biases), KV heads >= tp and < tp (shared by several ranks),
replicated biases of row-parallel projections and tied embeddings. A step every rank refuses (a bad
page) leaves the group working. A worker killed mid-run fails
the leader's step with `TpGroupFailed` (a gRPC UNAVAILABLE), not a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.tp_reference import reference_tokens, run_leader

pytest.importorskip("transformers")

# name -> (world, checkpoint overrides)
DEFAULT = {
    "llama-bias-kv2-tp2": (2, {"arch": "llama", "attention_bias": True, "mlp_bias": True, "seed": 11}),
    "mistral-window-kv1-tp2": (2, {"arch": "mistral", "kv_heads": 1, "sliding_window": 6, "seed": 12}),
    "qwen2-kv2-tied-tp2": (2, {"arch": "qwen2", "tie_embeddings": True, "seed": 13}),
}
LONG = {
    "llama-kv4-tp4": (4, {"arch": "llama", "kv_heads": 4, "seed": 14}),
    "llama-kv2-tp4": (4, {"arch": "llama", "seed": 15}),
    "mistral-window-kv1-tp4": (4, {"arch": "mistral", "kv_heads": 1, "sliding_window": 6, "seed": 16}),
    "qwen2-kv4-tp4": (4, {"arch": "qwen2", "kv_heads": 4, "seed": 17}),
    "qwen2-kv2-tp4": (4, {"arch": "qwen2", "sliding_window": 5, "seed": 18}),
}


def check(tiny_model_factory: Callable[..., Path], world: int, overrides: dict[str, object]) -> None:
    model = tiny_model_factory(**overrides)
    assert run_leader(model, world) == {"tokens": reference_tokens(model), "refused": "InvalidArgument"}


@pytest.mark.parametrize("name", sorted(DEFAULT))
def test_tp2_greedy_equals_transformers(tiny_model_factory: Callable[..., Path], name: str) -> None:
    check(tiny_model_factory, *DEFAULT[name])


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(LONG))
def test_tp4_greedy_equals_transformers(tiny_model_factory: Callable[..., Path], name: str) -> None:
    check(tiny_model_factory, *LONG[name])


def test_killed_rank_fails_the_step_with_a_clear_error(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory(arch="llama")
    result = run_leader(model, 2, "--kill-rank", "1", "--timeout", "5")
    assert result["error"] == "TpGroupFailed"
    assert "a rank of the tensor-parallel group failed" in str(result["message"])
