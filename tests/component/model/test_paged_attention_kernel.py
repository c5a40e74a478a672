"""The Triton paged-attention kernel (under TRITON_INTERPRET=1 on CPU tensors) against the torch path.

Attention alone over random pages (decode and resumed slices mixed, scattered pages, GQA/MQA,
head_dim 48, block sizes 4 and 16, sliding windows, float32 and bfloat16), the whole model on a
tiny checkpoint, and the static decode context that CUDA graphs replay.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from replica.errors import InvalidArgument
from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice, StaticDecodeContext
from replica.model.config import ModelConfig
from replica.model.llama import load_model
from replica.model.paged_attention import PagedBatch, paged_attention, triton_available


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """TRITON_INTERPRET=1 before the kernel is built (it is built per value of the variable)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = triton_available()
    if reason is not None:
        pytest.skip(reason)
    yield


def _config(heads: int, kv_heads: int, head_dim: int, window: int | None) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["MistralForCausalLM"],
            "vocab_size": 10,
            "hidden_size": heads * head_dim,
            "head_dim": head_dim,
            "intermediate_size": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "sliding_window": window,
        }
    )


def _scattered_batch(block_size: int, blocks: int, gen: torch.Generator) -> list[SeqSlice]:
    """Decodes and resumed slices (plus one fresh prompt) over pages drawn at random from the cache."""
    shapes = [(70, 1), (5, 1), (0, 1), (9, 6), (3, 2), (0, 5), (block_size, 3)]  # (start, length)
    order = torch.randperm(blocks, generator=gen).tolist()
    seqs = []
    for start, length in shapes:
        needed = -(-(start + length) // block_size)
        pages, order = order[:needed], order[needed:]
        seqs.append(SeqSlice(tuple(pages), start, length))
    return seqs


CASES = [  # heads, kv_heads, head_dim, block_size, window, dtype
    (4, 2, 16, 4, None, torch.float32),
    (4, 1, 48, 16, None, torch.float32),
    (4, 2, 48, 4, 7, torch.float32),
    (4, 4, 16, 16, 20, torch.float32),
    (4, 2, 16, 4, None, torch.bfloat16),
    (4, 1, 48, 4, 5, torch.bfloat16),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "window", "dtype"), CASES)
def test_kernel_attention_equals_the_torch_path(
    interpreted: None,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
) -> None:
    config = _config(heads, kv_heads, head_dim, window)
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    blocks = 48 if block_size == 4 else 16
    seqs = _scattered_batch(block_size, blocks, gen)
    n = sum(s.length for s in seqs)
    reference = PagedKVCache.for_model(config, blocks, block_size, dtype)
    reference.tensor.copy_(torch.randn(reference.tensor.shape, generator=gen))  # cached prefixes
    paged = PagedKVCache.for_model(config, blocks, block_size, dtype)
    paged.tensor.copy_(reference.tensor)
    q = torch.randn(n, heads + kv_heads, head_dim, generator=gen).to(dtype)[
        :, :heads
    ]  # strided, as the model's
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    want = AttentionContext.build(reference, seqs, config).attend(1, q, k, v)
    ctx = AttentionContext.build(paged, seqs, config, backend="triton")
    assert ctx.kernel is not None and len(ctx.groups) == 1  # the prompt went to SDPA, the rest to the kernel
    got = ctx.attend(1, q, k, v)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    assert torch.equal(paged.tensor, reference.tensor)  # the same K/V written into the same slots


def test_small_key_blocks_run_the_online_softmax_over_many_tiles(interpreted: None) -> None:
    """key_block 16 over 70 keys: five tiles, one partly before the window, rescaled as they come."""
    config = _config(4, 2, 16, None)
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache.for_model(config, 40, 4, torch.float32)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen))
    pages = tuple(torch.randperm(40, generator=gen)[:18].tolist())
    q = torch.randn(4, 4, 16, generator=gen)
    for window in (None, 30):
        want = torch.cat([_naive(cache, pages, pos, window, q[i]) for i, pos in enumerate([69, 60, 61, 62])])
        batch = PagedBatch(torch.tensor([[0, 69, 1], [1, 60, 3]]), torch.tensor([pages, pages]), max_new=3)
        out = torch.full((4, 64), float("nan"))
        paged_attention(q, cache.layer(0), batch, out, window, key_block=16)
        torch.testing.assert_close(out.reshape(-1), want, atol=1e-5, rtol=1e-5)


def _naive(
    cache: PagedKVCache, pages: tuple[int, ...], pos: int, window: int | None, q: torch.Tensor
) -> torch.Tensor:
    """One query (heads, head_dim) at `pos` over exactly the keys it sees, read position by position."""
    bs, layer = cache.block_size, cache.tensor[0]  # (blocks, 2, bs, kv_heads, head_dim)
    seen = range(0 if window is None else max(0, pos - window + 1), pos + 1)
    keys = torch.stack([layer[pages[p // bs], 0, p % bs] for p in seen])  # (keys, kv_heads, head_dim)
    values = torch.stack([layer[pages[p // bs], 1, p % bs] for p in seen])
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q, keys) / q.shape[-1] ** 0.5
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), values).reshape(-1)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_model_forward_with_the_kernel_equals_the_torch_path(
    interpreted: None, tiny_model_factory: Callable[..., Path], arch: str
) -> None:
    """Prompts, then a resumed chunk next to decodes: the same logits and pages on both backends."""
    window = {"sliding_window": 5} if arch == "mistral" else {}
    loaded = load_model(tiny_model_factory(arch=arch, kv_heads=2, **window), torch.float32)
    model, config = loaded.model, loaded.config
    caches = {b: PagedKVCache.for_model(config, 24, 4, torch.float32) for b in ("torch", "triton")}
    steps = [
        [SeqSlice((3, 9, 13), 0, 7), SeqSlice((11, 2, 17), 0, 4)],
        [SeqSlice((3, 9, 13), 7, 1), SeqSlice((11, 2, 17), 4, 5), SeqSlice((0,), 0, 3)],
        [SeqSlice((3, 9, 13), 8, 1), SeqSlice((11, 2, 17), 9, 1), SeqSlice((0,), 3, 1)],
    ]
    gen = torch.Generator().manual_seed(7)
    for seqs in steps:
        ids = torch.randint(0, config.vocab_size, (sum(s.length for s in seqs),), generator=gen)
        logits = {}
        for backend, cache in caches.items():
            ctx = AttentionContext.build(cache, seqs, config, backend=backend)
            logits[backend] = model.head(model(ids, ctx)[ctx.last_token_index])
        torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches["triton"].tensor, caches["torch"].tensor, atol=1e-5, rtol=1e-5)


def test_static_decode_context_equals_the_ordinary_context(
    interpreted: None, tiny_model_factory: Callable[..., Path]
) -> None:
    """Three real rows padded to 4: the real rows' logits and every page equal the torch path's."""
    loaded = load_model(tiny_model_factory(arch="mistral", kv_heads=2, sliding_window=6), torch.float32)
    model, config = loaded.model, loaded.config
    eager = PagedKVCache.for_model(config, 24, 4, torch.float32)
    prompts = [((4, 8, 15), 9), ((16, 23), 5), ((1,), 2)]  # (pages, cached tokens)
    seqs = [SeqSlice(pages, 0, length) for pages, length in prompts]
    ids = torch.arange(3, 3 + sum(s.length for s in seqs))
    model(ids, AttentionContext.build(eager, seqs, config))
    static = PagedKVCache.for_model(config, 24, 4, torch.float32)
    static.tensor.copy_(eager.tensor)
    ctx = StaticDecodeContext(static, config, max_seqs=8, max_pages=4)
    addresses = [t.data_ptr() for t in (ctx.positions, ctx.cos, ctx.k_rows)]
    tokens = torch.tensor([40, 41, 42])
    for step in range(2):
        decode = [SeqSlice(pages, length + step, 1) for pages, length in prompts]
        want = model.head(model(tokens, AttentionContext.build(eager, decode, config)))
        ctx.fill(decode, padded_to=4)
        assert [t.data_ptr() for t in (ctx.positions, ctx.cos, ctx.k_rows)] == addresses
        padded = torch.cat((tokens, tokens[:1]))  # padded rows repeat row 0
        got = model.head(model(padded, ctx))
        assert ctx.positions.tolist() == [9 + step, 5 + step, 2 + step, 9 + step]
        torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[3], got[0], atol=0, rtol=0)
        torch.testing.assert_close(static.tensor, eager.tensor, atol=1e-5, rtol=1e-5)
        tokens = tokens + 1


def test_static_decode_context_refuses_what_it_cannot_hold() -> None:
    config = _config(4, 2, 16, None)
    cache = PagedKVCache.for_model(config, 16, 4, torch.float32)
    ctx = StaticDecodeContext(cache, config, max_seqs=2, max_pages=2)
    with pytest.raises(InvalidArgument, match="sequence 0: a decode row feeds one token"):
        ctx.fill([SeqSlice((1,), 0, 2)], 1)
    with pytest.raises(InvalidArgument, match="sequence 0: 3 pages, at most 2"):
        ctx.fill([SeqSlice((1, 2, 3), 9, 1)], 1)
    with pytest.raises(InvalidArgument, match="padded to 3"):
        ctx.fill([SeqSlice((1,), 0, 1)], 3)
    with pytest.raises(InvalidArgument, match="page id outside"):
        ctx.fill([SeqSlice((16,), 0, 1)], 1)
    ctx.fill([SeqSlice((5,), 2, 1), SeqSlice((6, 7), 4, 1)], 2)
    # the page table is page-major: column j of every row, then the next page
    assert ctx._batch.pages.tolist() == [[5, 0], [6, 7]]
    assert ctx.k_rows.tolist() == [5 * 8 + 2, 7 * 8 + 0] and ctx.v_rows.tolist() == [5 * 8 + 6, 7 * 8 + 4]


def test_unknown_backend_is_refused() -> None:
    config = _config(4, 2, 16, None)
    cache = PagedKVCache.for_model(config, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        AttentionContext.build(cache, [SeqSlice((0,), 0, 1)], config, backend="cuda")


def test_the_torch_path_never_imports_triton() -> None:
    """A CPU run that picks the torch backend must not import triton (nor pay for it)."""
    code = (
        "import sys, torch\n"
        "from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice\n"
        "from replica.model.config import ModelConfig\n"
        "c = ModelConfig.from_dict({'architectures': ['LlamaForCausalLM'], 'vocab_size': 10,"
        " 'hidden_size': 16, 'intermediate_size': 8, 'num_hidden_layers': 1, 'num_attention_heads': 2})\n"
        "cache = PagedKVCache.for_model(c, 4, 4, torch.float32)\n"
        "AttentionContext.build(cache, [SeqSlice((0,), 0, 3)], c).attend(0, *[torch.ones(3, 2, 8)] * 3)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])
