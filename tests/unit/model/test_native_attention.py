"""The C++ CPU decode kernel (`--attention-backend native`) against the torch path.

Each shape builds once (~0.5 s with g++, then found in the kernel cache under the temp directory).
"""

from __future__ import annotations

import logging

import pytest
import torch

from replica.model import native_attention
from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice
from replica.model.config import ModelConfig

pytestmark = pytest.mark.skipif(native_attention.compiler_missing() is not None, reason="no C++ compiler")
BLOCK = 4


def _config(window: int | None, heads: int = 6, kv_heads: int = 2, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(architecture="MistralForCausalLM", vocab_size=64, hidden_size=heads * head_dim,
                       intermediate_size=64, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=head_dim, max_position_embeddings=128, sliding_window=window)


def _step(
    config: ModelConfig, slices: list[SeqSlice], backend: str, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward's attention over a random cache (same seed for every backend): output and cache."""
    gen = torch.Generator().manual_seed(len(slices))
    cache = PagedKVCache.for_model(config, 40, BLOCK, dtype)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen))
    n = sum(s.length for s in slices)
    # q as the model passes it: a strided view of the rotated q|k heads
    qk = torch.randn(n, config.num_heads + config.num_kv_heads, config.head_dim, generator=gen).to(dtype)
    v = torch.randn(n, config.num_kv_heads, config.head_dim, generator=gen).to(dtype)
    ctx = AttentionContext.build(cache, slices, config, backend=backend)
    return ctx.attend(0, qk[:, : config.num_heads], qk[:, config.num_heads :], v), cache.tensor


def _decodes(count: int, seed: int = 0) -> list[SeqSlice]:
    """`count` one-token slices (1 to 30 cached tokens) over scattered pages."""
    gen = torch.Generator().manual_seed(seed)
    slices = []
    for i in range(count):
        start = 1 + (i * 11) % 30
        pages = torch.randperm(40, generator=gen)[: start // BLOCK + 1].tolist()
        slices.append(SeqSlice(tuple(pages), start, 1))
    return slices


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seqs", [1, 5])
# (heads, kv heads, head_dim): head_dim 8 the plain loops; 16 and 32 the vector dot products, four
# heads at a time (6 heads: four, then two one by one)
@pytest.mark.parametrize("shape", [(6, 2, 8), (6, 2, 16), (4, 1, 32)])
def test_decode_step_equals_the_torch_path(
    window: int | None, seqs: int, shape: tuple[int, int, int]
) -> None:
    config = _config(window, *shape)
    want, cache_want = _step(config, _decodes(seqs), "torch")
    got, cache_got = _step(config, _decodes(seqs), "native")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache_got, cache_want)  # the kernel wrote the new K/V rows into their slots


def test_several_threads_split_the_sequences_with_the_same_result() -> None:
    config = _config(None, 8, 2, 16)
    slices = _decodes(13)
    alone, cache_alone = _step(config, slices, "native")
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # 13 sequences: pieces of 4, 4 and 5 on three threads
    try:
        split, cache_split = _step(config, slices, "native")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, alone) and torch.equal(cache_split, cache_alone)
    want, _ = _step(config, slices, "torch")
    torch.testing.assert_close(split, want, atol=1e-5, rtol=1e-5)


def test_mixed_batch_decodes_through_the_kernel() -> None:
    # decodes next to a fresh prompt and a resumed slice: K/V written by torch, decodes by the kernel
    config = _config(6)
    slices = [*_decodes(3), SeqSlice((7, 8), 0, 6), SeqSlice((9, 10, 11), 5, 4)]
    want, cache_want = _step(config, slices, "torch")
    got, cache_got = _step(config, slices, "native")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache_got, cache_want)


def test_other_dtypes_keep_the_torch_path() -> None:
    config = _config(None)
    cache = PagedKVCache.for_model(config, 8, BLOCK, torch.bfloat16)
    assert native_attention.kernel_for(cache.layer(0), 3 * cache.num_kv_heads, cache.head_dim) is None
    want, _ = _step(config, _decodes(3), "torch", torch.bfloat16)
    got, _ = _step(config, _decodes(3), "native", torch.bfloat16)
    assert torch.equal(got, want)


def test_a_failed_build_is_reported_and_the_replica_keeps_torch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from replica.engine import factory
    from replica.engine.device import DeviceChoice, DType

    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails: `false` is on PATH everywhere
    native_attention.compiler_missing.cache_clear()
    shape = native_attention.Shape(BLOCK, 1, 3, 8)
    try:
        with pytest.raises(native_attention.NativeBuildError, match="false failed"):
            native_attention.build.__wrapped__(shape)
        config = _config(None, 3, 1)
        cache = PagedKVCache.for_model(config, 8, BLOCK, torch.float32)
        monkeypatch.setattr(native_attention, "build", native_attention.build.__wrapped__)
        choice = DeviceChoice(torch.device("cpu"), DType.FLOAT32, "native", "")
        with caplog.at_level(logging.WARNING):
            assert factory._kernels_built(choice, cache, config).attention_backend == "torch"
        assert "falls back to the torch path: the native kernel: false failed" in caplog.text
        # a shape first met later (a model switch) keeps the torch path too, said once
        with caplog.at_level(logging.WARNING):
            assert native_attention._built_or_none.__wrapped__(shape) is None
        assert "decode attention keeps the torch path" in caplog.text
    finally:
        native_attention.compiler_missing.cache_clear()
