"""The fed token ids ride in the context's one host->device copy: same values, checked lengths."""

from __future__ import annotations

import pytest
import torch

from replica.errors import InvalidArgument
from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice
from replica.model.config import ModelConfig


def _config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)


def test_token_ids_come_with_the_indices() -> None:
    config = _config()
    cache = PagedKVCache.for_model(config, 8, 4, torch.float32)
    slices = [SeqSlice((1, 2), 0, 5), SeqSlice((3,), 2, 1)]
    ctx = AttentionContext.build(cache, slices, config, token_ids=[5, 6, 7, 8, 9, 10])
    assert ctx.token_ids is not None and ctx.token_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert ctx.positions.tolist() == [0, 1, 2, 3, 4, 2]
    assert AttentionContext.build(cache, slices, config).token_ids is None
    with pytest.raises(InvalidArgument, match="5 token ids for 6 new tokens"):
        AttentionContext.build(cache, slices, config, token_ids=[1, 2, 3, 4, 5])
