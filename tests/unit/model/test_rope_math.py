"""RoPE math: frequencies per scaling type, rotation properties (norm kept, relative positions only)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from replica.model.config import ModelConfig
from replica.model.rope import cos_sin, inverse_frequencies, rotate, rotation_rows, signed_sin


def _config(**overrides: Any) -> ModelConfig:
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
    }
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


def test_default_frequencies() -> None:
    inv_freq, scale = inverse_frequencies(_config())
    expected = torch.tensor([10000.0 ** (-2 * i / 16) for i in range(8)])
    torch.testing.assert_close(inv_freq, expected)
    assert scale == 1.0


def test_linear_divides_by_factor_and_dynamic_equals_default_below_max() -> None:
    base, _ = inverse_frequencies(_config())
    linear, _ = inverse_frequencies(_config(rope_scaling={"type": "linear", "factor": 4.0}))
    dynamic, _ = inverse_frequencies(_config(rope_scaling={"type": "dynamic", "factor": 4.0}))
    torch.testing.assert_close(linear, base / 4)
    torch.testing.assert_close(dynamic, base)


def test_llama3_keeps_high_frequencies_and_scales_low_ones() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    base, _ = inverse_frequencies(_config())
    scaled, _ = inverse_frequencies(_config(rope_scaling=scaling))
    wavelen = 2 * math.pi / base
    high = wavelen < 64 / 4
    low = wavelen > 64 / 1
    assert high.any() and low.any()
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8)
    middle = ~high & ~low
    assert bool(((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all())


def test_yarn_attention_factor_and_ramp() -> None:
    base, _ = inverse_frequencies(_config())
    yarn, scale = inverse_frequencies(_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert math.isclose(scale, 0.1 * math.log(4.0) + 1.0)
    torch.testing.assert_close(yarn[0], base[0])  # fastest rotation extrapolated (kept)
    torch.testing.assert_close(yarn[-1], base[-1] / 4)  # slowest interpolated (divided)


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' form: x * cos + rotate_half(x) * sin, tables (n, head_dim) broadcast over heads."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's rotation (`rotate`) from plain cos / sin tables (n, head_dim)."""
    return rotate(x, cos[:, None, :], signed_sin(sin)[:, None, :])


def test_rotation_keeps_norm_and_position_zero_is_identity() -> None:
    inv_freq, scale = inverse_frequencies(_config())
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = cos_sin(inv_freq, scale, torch.arange(5), torch.float32)
    rotated = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[0], x[0])


def test_scores_depend_on_relative_position_only() -> None:
    inv_freq, scale = inverse_frequencies(_config())
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)

    def score(qpos: int, kpos: int) -> float:
        cq, sq = cos_sin(inv_freq, scale, torch.tensor([qpos]), torch.float32)
        ck, sk = cos_sin(inv_freq, scale, torch.tensor([kpos]), torch.float32)
        return float((apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum())

    assert math.isclose(score(10, 7), score(103, 100), rel_tol=1e-4)
    assert not math.isclose(score(10, 7), score(10, 2), rel_tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotate_equals_the_reference_rotation_bit_for_bit(dtype: torch.dtype) -> None:
    # the model's fast form (roll + signed sin) against transformers' rotate_half form
    config = _config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    positions = torch.tensor([0, 7, 3, 300, 511])
    inv_freq, scale = inverse_frequencies(config)
    cos, sin = cos_sin(inv_freq, scale, positions, dtype)
    x = (torch.randn(5, 6, 16, generator=torch.Generator().manual_seed(2)) * 30).to(dtype)
    expected = reference_rotary(x, cos, sin)
    assert torch.equal(apply_rotary(x, cos, sin), expected)
    rows_cos, rows_sin = rotation_rows(config, positions, dtype)  # the memoised table's rows
    assert rows_cos.shape == (5, 1, 16)
    assert torch.equal(rotate(x, rows_cos, rows_sin), expected)
