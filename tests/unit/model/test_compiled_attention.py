"""The compiled CPU decode attention (`--attention-backend compiled`) against the torch path.

The kernel's eager form (`paged_decode`) is checked in the default tier; compiling it takes
seconds to tens of seconds (inductor builds C++), so the compiled comparisons are `long`.
"""

from __future__ import annotations

import pytest
import torch

from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice
from replica.model.compiled_attention import compiler_missing, paged_decode
from replica.model.config import ModelConfig

BLOCK = 4


def _config(window: int | None) -> ModelConfig:
    return ModelConfig(architecture="MistralForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=64,
                       num_layers=1, num_heads=6, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                       sliding_window=window)


def _decode_step(
    config: ModelConfig, seqs: int, backend: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of `seqs` sequences (1 to 30 cached tokens, scattered and shared pages) over a
    random cache: the attention output and the cache after the step."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache.for_model(config, 40, BLOCK, torch.float32)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen))
    slices = []
    for i in range(seqs):
        start = 1 + (i * 11) % 30
        pages = torch.randperm(40, generator=gen)[: start // BLOCK + 1].tolist()
        slices.append(SeqSlice(tuple(pages), start, 1))
    q = torch.randn(seqs, config.num_heads, config.head_dim, generator=gen)
    k, v = (torch.randn(seqs, config.num_kv_heads, config.head_dim, generator=gen) for _ in range(2))
    ctx = AttentionContext.build(cache, slices, config, backend=backend)
    return ctx.attend(0, q, k, v), cache.tensor


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seqs", [1, 5])
def test_kernel_math_equals_the_torch_path(
    window: int | None, seqs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the compiled backend's wiring, with the kernel run eagerly (no compiler needed)
    from replica.model import compiled_attention

    monkeypatch.setattr(compiled_attention, "_compiled", lambda: paged_decode)
    config = _config(window)
    want, cache_want = _decode_step(config, seqs, "torch")
    got, cache_got = _decode_step(config, seqs, "compiled")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache_got, cache_want)


@pytest.mark.long
@pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler for inductor")
def test_compiled_equals_eager_without_recompiling() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() keeps the process's counters: earlier tests' graphs would count here
    for window, seqs in ((None, 1), (None, 7), (6, 5), (6, 1)):
        config = _config(window)
        want, _ = _decode_step(config, seqs, "torch", seed=seqs)
        got, _ = _decode_step(config, seqs, "compiled", seed=seqs)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # batch sizes, page counts and windows share one compiled graph
    assert counters["stats"]["unique_graphs"] == 1
