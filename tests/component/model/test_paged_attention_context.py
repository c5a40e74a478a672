"""AttentionContext over the paged cache: indices, page writes, batching independence, refused slices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replica.errors import InvalidArgument
from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice, as_int64
from replica.model.config import ModelConfig
from replica.model.llama import load_model


def _config(**extra: object) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 16,
            "intermediate_size": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            **extra,
        }
    )


def test_positions_last_index_and_page_writes() -> None:
    config = _config()
    cache = PagedKVCache.for_model(config, num_blocks=8, block_size=4, dtype=torch.float32)
    seqs = [SeqSlice((5, 2), 0, 6), SeqSlice((7, 1, 3), 9, 1), SeqSlice((0, 4), 2, 3)]
    ctx = AttentionContext.build(cache, seqs, config)
    assert ctx.positions.tolist() == [0, 1, 2, 3, 4, 5, 9, 2, 3, 4]
    assert ctx.last_token_index.tolist() == [5, 6, 9]
    n = 10
    k = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, 2, 4) + 1
    ctx.attend(1, torch.zeros(n, 4, 4), k, -k)
    layer = cache.tensor[1]  # (blocks, 2, block_size, kv_heads, head_dim)
    assert layer[2, 0, 1, 0, 0] == 6  # seq 0 position 5 -> page 2 slot 1
    assert layer[3, 0, 1, 0, 0] == 7  # seq 1 position 9 -> page 3 slot 1
    assert layer[4, 1, 0, 0, 0] == -10  # seq 2 position 4 -> page 4 slot 0, V half
    assert not cache.tensor[0].any()  # other layer untouched
    assert cache.bytes_per_page() == 2 * 4 * 2 * 4 * 4
    assert PagedKVCache.bytes_per_block(config, 4, torch.bfloat16) == 2 * 2 * 4 * 2 * 4 * 2


@pytest.mark.parametrize(
    ("seqs", "message"),
    [
        ([], "at least one"),
        ([SeqSlice((0,), 0, 0)], "not a valid slice"),
        ([SeqSlice((0,), 3, 2)], "need 2 pages"),
        ([SeqSlice((0, 99), 3, 2)], "outside the cache"),
        ([SeqSlice((1,), 0, 2), SeqSlice((-1,), 0, 1)], "sequence 1: page id outside"),
        # the first faulty slice is reported, whatever the later ones' problems
        ([SeqSlice((99,), 0, 1), SeqSlice((0,), 0, 0)], "sequence 0: page id outside"),
        ([SeqSlice((1,), 3, 2), SeqSlice((99,), 0, 1)], "sequence 0: 5 tokens need 2 pages, got 1"),
    ],
)
def test_invalid_slices_are_refused(seqs: list[SeqSlice], message: str) -> None:
    config = _config()
    cache = PagedKVCache.for_model(config, num_blocks=8, block_size=4, dtype=torch.float32)
    with pytest.raises(InvalidArgument, match=message):
        AttentionContext.build(cache, seqs, config)


def test_a_sequence_decodes_the_same_alone_or_in_a_batch(tiny_llama: Path) -> None:
    loaded = load_model(tiny_llama, torch.float32)
    model, config = loaded.model, loaded.config
    cache = PagedKVCache.for_model(config, num_blocks=16, block_size=4, dtype=torch.float32)
    prompts = [list(range(3, 14)), [1, 2, 3], list(range(20, 27))]
    pages = [(9, 1, 4), (0,), (12, 6)]
    seqs = [SeqSlice(p, 0, len(t)) for p, t in zip(pages, prompts, strict=True)]
    ids = torch.tensor([tok for t in prompts for tok in t])
    model(ids, AttentionContext.build(cache, seqs, config))
    decode = [SeqSlice(p, len(t), 1) for p, t in zip(pages, prompts, strict=True)]
    batch = model.head(model(torch.tensor([40, 41, 42]), AttentionContext.build(cache, decode, config)))
    alone = model.head(model(torch.tensor([41]), AttentionContext.build(cache, decode[1:2], config)))
    torch.testing.assert_close(batch[1:2], alone, atol=1e-5, rtol=0)


def test_dropping_the_tensor_drops_the_layer_views() -> None:
    """Resizing the cache assigns an empty tensor first; no per-layer view may keep the old pages alive."""
    cache = PagedKVCache.for_model(_config(), num_blocks=8, block_size=4, dtype=torch.float32)
    assert len(cache.rows) == 2 and cache.rows[1].data_ptr() == cache.tensor[1].data_ptr()
    cache.tensor = torch.empty(0)
    assert cache.rows == [] and cache.key_pages == [] and cache.value_pages == []


def test_interleaved_kinds_equal_each_sequence_alone(tiny_llama: Path) -> None:
    """prompt, decode, resumed chunk and prompt interleaved in one batch = each run on its own."""
    loaded = load_model(tiny_llama, torch.float32)
    model, config = loaded.model, loaded.config
    shared = PagedKVCache.for_model(config, num_blocks=24, block_size=4, dtype=torch.float32)
    history = {1: (list(range(5, 14)), (7, 3, 11)), 2: (list(range(30, 36)), (2, 19, 21))}
    for tokens, pages in history.values():  # cache the earlier tokens of sequences 1 and 2
        model(torch.tensor(tokens), AttentionContext.build(shared, [SeqSlice(pages, 0, len(tokens))], config))
    private = PagedKVCache.for_model(config, num_blocks=24, block_size=4, dtype=torch.float32)
    private.tensor.copy_(shared.tensor)
    batch = [
        (SeqSlice((0, 1), 0, 6), [3, 4, 5, 6, 7, 8]),  # prompt
        (SeqSlice(history[1][1], 9, 1), [40]),  # decode
        (SeqSlice(history[2][1], 6, 3), [41, 42, 43]),  # resumed chunk
        (SeqSlice((5, 6, 8), 0, 10), list(range(50, 60))),  # prompt
    ]
    ids = torch.tensor([t for _, tokens in batch for t in tokens])
    ctx = AttentionContext.build(shared, [s for s, _ in batch], config)
    together = model.head(model(ids, ctx)).split([len(tokens) for _, tokens in batch])
    for (seq, tokens), rows in zip(batch, together, strict=True):
        alone = model.head(model(torch.tensor(tokens), AttentionContext.build(private, [seq], config)))
        torch.testing.assert_close(rows, alone, atol=1e-5, rtol=0)
    # later layers' K/V come from a batched vs a single-sequence matmul: a few ulp apart
    torch.testing.assert_close(shared.tensor, private.tensor, atol=1e-5, rtol=0)


def test_index_lists_become_int64_tensors_through_a_buffer() -> None:
    cpu = torch.device("cpu")
    values = as_int64([3, -1, 2**40], cpu)
    assert values.dtype == torch.int64 and values.tolist() == [3, -1, 2**40]
    assert as_int64([], cpu).shape == (0,)


def _naive_decode(
    cache: PagedKVCache, layer: int, pages: tuple[int, ...], pos: int, window: int, q: torch.Tensor
) -> torch.Tensor:
    """One query at `pos` over exactly the keys `(pos - window, pos]`, read position by position."""
    bs, layer_pages = cache.block_size, cache.tensor[layer]  # (blocks, 2, bs, kv_heads, head_dim)
    seen = range(max(0, pos - window + 1), pos + 1)
    keys = torch.stack([layer_pages[pages[p // bs], 0, p % bs] for p in seen])  # (n, kv_heads, d)
    values = torch.stack([layer_pages[pages[p // bs], 1, p % bs] for p in seen])
    heads, kv_heads = q.shape[0], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    values = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("hd,nhd->hn", q, keys) / q.shape[-1] ** 0.5
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), values).reshape(-1)


def test_sliding_window_decode_gathers_only_the_window_pages() -> None:
    """A decode step under a window reads only the pages the window reaches, with the same result
    as attention over exactly the window's keys; a window wider than every context keeps them all."""
    window, bs = 5, 4
    config = _config(architectures=["MistralForCausalLM"], sliding_window=window)
    cache = PagedKVCache.for_model(config, num_blocks=16, block_size=bs, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen))  # every slot a distinct key
    pages = [(3,), (9, 1, 4, 12), (0, 7, 2, 5, 6, 11)]
    starts = [2, 15, 22]  # inside the window; its oldest key the last of a page; mid-page
    decode = [SeqSlice(p, s, 1) for p, s in zip(pages, starts, strict=True)]
    ctx = AttentionContext.build(cache, decode, config)
    view = ctx.groups[0].windowed(window)
    assert view is not None and view.ctx == 2 * bs  # 2 pages per row instead of 6
    assert view.first_pos.tolist() == [0, 8, 16]
    q = torch.randn(3, 4, 4, generator=gen)
    k, v = torch.randn(3, 2, 4, generator=gen), torch.randn(3, 2, 4, generator=gen)
    out = ctx.attend(1, q, k, v)
    for row, (seq_pages, start) in enumerate(zip(pages, starts, strict=True)):
        expected = _naive_decode(cache, 1, seq_pages, start, window, q[row])
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
    assert ctx.groups[0].windowed(64) is None and ctx.groups[0].windowed(None) is None
