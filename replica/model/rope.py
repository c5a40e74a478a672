"""Rotary position embeddings: inverse frequencies (with scaling), cos/sin tables, and the rotation.

The arithmetic follows transformers' order of operations (float32 frequencies, cos/sin scaled by the
attention factor in float32, then cast to the model dtype; the rotation in the model dtype) so that
bfloat16/float16 results match it bit for bit, not merely approximately.
"""

from __future__ import annotations

import functools
import math

import torch

from replica.model.config import ModelConfig, RopeKind, RopeScaling


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the middle band blended.
    old_context = s.original_max_position_embeddings or 8192
    low_wavelen = old_context / s.low_freq_factor
    high_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


def _yarn_inv_freq(theta: float, dim: int, s: RopeScaling, max_positions: int) -> torch.Tensor:
    # YaRN: interpolate low frequencies by `factor`, keep high ones, with a linear ramp between.
    original = s.original_max_position_embeddings or max_positions

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(head_dim/2,) float32 inverse frequencies and the cos/sin scale (attention factor)."""
    s, dim, theta = config.rope_scaling, config.head_dim, config.rope_theta
    if s.kind is RopeKind.YARN:
        return _yarn_inv_freq(theta, dim, s, config.max_position_embeddings), _yarn_attention_factor(s)
    inv_freq = _default_inv_freq(theta, dim)
    if s.kind is RopeKind.LINEAR:
        inv_freq = inv_freq / s.factor
    elif s.kind is RopeKind.LLAMA3:
        inv_freq = _llama3_inv_freq(inv_freq, s)
    # DEFAULT and DYNAMIC (below max_position_embeddings) use the plain frequencies.
    return inv_freq, 1.0


def cos_sin(
    inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (n, head_dim) for absolute `positions` (n,), in `dtype`."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]  # (n, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (n, head_dim)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """`sin` (..., head_dim) with its first half negated: the table `rotate` multiplies the rolled x by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (n, heads, head_dim): cos (n, 1, head_dim), sin_signed = `signed_sin(sin)`.

    The same bits as transformers' form `x * cos + rotate_half(x) * sin` (tested), in fewer ops:

    rotate_half(x) * sin = cat(-x2, x1) * sin = roll(x) * cat(-sin1, sin2) exactly (negation is exact
    and rounding is sign-symmetric), so one roll replaces two slices, a negation and a cat.
    """
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * sin_signed)


@functools.lru_cache(maxsize=16)
def rotation_table(
    config: ModelConfig, dtype: torch.dtype, length: int, device: torch.device
) -> torch.Tensor:
    """(length, 2, head_dim) on `device`: cos and signed sin of every position, side by side (one
    gather for both), memoised per (config, dtype, length, device).

    Computed on the CPU and copied once, so every device holds the same bits as the CPU table (and
    a forward never sends positions to the host and back).
    """
    inv_freq, scale = inverse_frequencies(config)
    cos, sin = cos_sin(inv_freq, scale, torch.arange(length), dtype)
    return torch.stack((cos, signed_sin(sin)), dim=1).to(device)


def table_length(highest: int) -> int:
    """The table length covering positions below `highest`: a power of two, at least 256 (few tables)."""
    return max(256, 1 << (highest - 1).bit_length())


def rotation_rows(
    config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype, highest: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `rotate` takes for `positions`: cos and signed-sin rows, each (n, 1, head_dim).

    They are read from a memoised per-model table on the positions' device holding every position
    below a power of two covering the largest one asked for, so a forward costs one row gather
    instead of recomputing the trigonometry (same values: elementwise). `highest` (one past the
    largest position), when the caller knows it, saves a device sync.
    """
    if highest is None:
        highest = int(positions.max()) + 1 if positions.numel() else 1
    table = rotation_table(config, dtype, table_length(highest), positions.device)
    rows = table.index_select(0, positions)
    return rows[:, :1], rows[:, 1:]  # (n, 1, head_dim) views
