"""Checkpoints written by transformers' own `save_pretrained` (sharded by size, its config keys) match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice
from replica.model.llama import load_model

transformers = pytest.importorskip("transformers")

SMALL = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
}
CASES: dict[str, tuple[str, dict[str, Any], torch.dtype]] = {
    "llama-tied-llama3": (
        "LlamaConfig",
        {
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
        torch.float32,
    ),
    "mistral-window-headdim": (
        "MistralConfig",
        {"num_key_value_heads": 1, "sliding_window": 5, "head_dim": 32},
        torch.bfloat16,
    ),
    "qwen2-mixed-windows": (
        "Qwen2Config",
        {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        torch.float32,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_pretrained_checkpoint_matches(case: str, tmp_path: Path) -> None:
    config_class, extra, dtype = CASES[case]
    config = getattr(transformers, config_class)(**SMALL, **extra)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for p in reference.parameters():  # spread the weights so logits are far from uniform
            p.normal_(mean=1.0 if p.dim() == 1 else 0.0, std=0.2 if p.dim() == 1 else 0.3)
    reference.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(tmp_path, dtype)
    tokens = torch.randint(3, 300, (13,), generator=torch.Generator().manual_seed(1))
    cache = PagedKVCache.for_model(loaded.config, 8, 4, dtype)
    ctx = AttentionContext.build(cache, [SeqSlice((5, 2, 7, 0), 0, 13)], loaded.config)
    ours = loaded.model.head(loaded.model(tokens, ctx))
    with torch.no_grad():
        ref = reference(tokens[None]).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4 if dtype == torch.float32 else 6e-2, rtol=0)
