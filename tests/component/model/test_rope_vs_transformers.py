"""Our RoPE frequencies and attention factor against transformers' own functions, per scaling type."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from replica.model.config import ModelConfig
from replica.model.rope import inverse_frequencies

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 256,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}
SCALINGS: list[dict[str, Any] | None] = [
    None,
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 512,
    },
    {"rope_type": "yarn", "factor": 4.0},
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "original_max_position_embeddings": 1024,
    },
    {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3},
]


@pytest.mark.parametrize(
    "scaling", SCALINGS, ids=lambda s: "default" if s is None else str(sorted(s.items()))
)
@pytest.mark.parametrize("head_dim", [None, 96])
def test_frequencies_match_transformers(scaling: dict[str, Any] | None, head_dim: int | None) -> None:
    raw = {**BASE, "rope_scaling": scaling, "head_dim": head_dim}
    ours, our_factor = inverse_frequencies(ModelConfig.from_dict(raw))
    hf_config = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    kind = "default" if scaling is None else scaling["rope_type"]
    theirs, their_factor = rope_utils.ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"))
    assert torch.equal(ours, theirs)
    assert our_factor == pytest.approx(their_factor, abs=0)
