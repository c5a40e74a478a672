"""Our model's logits against transformers' on the same tiny checkpoints.

For each checkpoint variant: a batch of ragged prompts goes through our model in one flat forward
(one prompt split into two chunks, the second resumed in the next step alongside decodes), then
several greedy decode steps, every sequence on scattered (non-contiguous, shuffled) KV pages.
transformers then runs each final sequence once without a cache; every logit row we produced must
match its row there (float32: atol 1e-4; bfloat16/float16: atol 6e-2 on logits of magnitude ~3) and
our greedy choice must be transformers' argmax wherever its top-2 gap exceeds the tolerance.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from replica.model.attention import AttentionContext, PagedKVCache, SeqSlice
from replica.model.llama import CausalLM, load_model

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
LLAMA3 = (
    '{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,'
    ' "original_max_position_embeddings": 32}'
)
YARN = '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}'
LINEAR = '{"type": "linear", "factor": 2.0}'

VARIANTS: dict[str, dict[str, object]] = {
    "llama": {"arch": "llama"},
    "mistral-window": {"arch": "mistral", "sliding_window": 6, "seed": 1},
    "qwen2-bias-window": {"arch": "qwen2", "sliding_window": 5, "layers": 3, "seed": 2},
    "llama-headdim-kv1-tied-sharded-llama3": {
        "arch": "llama",
        "head_dim": 24,
        "kv_heads": 1,
        "tie_embeddings": True,
        "shards": 3,
        "rope_scaling": LLAMA3,
        "rope_theta": 500000.0,
        "seed": 3,
    },
    "llama-bias-linear-mha": {
        "arch": "llama",
        "heads": 8,
        "kv_heads": 8,
        "hidden": 128,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_scaling": LINEAR,
        "seed": 4,
    },
    "qwen2-yarn-tied": {"arch": "qwen2", "rope_scaling": YARN, "tie_embeddings": True, "seed": 5},
    "llama-bfloat16": {"arch": "llama", "dtype": "bfloat16", "seed": 6},
    # q/k/v biases of 40 and 8 floats are not 64-byte multiples: the unfused projection path
    "qwen2-odd-sizes-unfused": {
        "arch": "qwen2",
        "hidden": 40,
        "heads": 5,
        "kv_heads": 1,
        "intermediate": 72,
        "seed": 8,
    },
    "mistral-float16-sharded": {"arch": "mistral", "dtype": "float16", "shards": 2, "seed": 7},
}


@dataclass
class Track:
    """One sequence's tokens and the logits rows we produced for positions of it."""

    tokens: list[int]
    pages: tuple[int, ...]
    done: int = 0  # tokens already in the cache
    rows: dict[int, torch.Tensor] | None = None  # position -> our logits predicting position+1


def _prompts(vocab: int, rng: random.Random) -> list[list[int]]:
    lengths = [1, 3, 7, 12, 17, 26]
    return [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lengths]


def _step(model: CausalLM, cache: PagedKVCache, tracks: list[Track], limits: list[int]) -> None:
    """One flat forward: each track feeds its tokens [done, limit); store all rows, advance."""
    seqs = [SeqSlice(t.pages, t.done, limit - t.done) for t, limit in zip(tracks, limits, strict=True)]
    ids = torch.tensor(
        [tok for t, limit in zip(tracks, limits, strict=True) for tok in t.tokens[t.done : limit]]
    )
    ctx = AttentionContext.build(cache, seqs, model.config)
    logits = model.head(model(ids, ctx))
    flat = 0
    for track, seq in zip(tracks, seqs, strict=True):
        for offset in range(seq.length):
            assert track.rows is not None
            track.rows[seq.start + offset] = logits[flat + offset]
        flat += seq.length
        track.done = seq.end
    for track in tracks:
        assert track.rows is not None
        if track.done == len(track.tokens):  # greedy: feed our own argmax next
            track.tokens.append(int(track.rows[track.done - 1].argmax()))


def _run_ours(path: Path, dtype: torch.dtype, decode_steps: int) -> list[Track]:
    rng = random.Random(0)
    loaded = load_model(path, dtype)
    prompts = _prompts(loaded.config.vocab_size, rng)
    max_len = max(map(len, prompts)) + decode_steps + 2
    pages_each = -(-max_len // BLOCK_SIZE)
    free = list(range(len(prompts) * pages_each + 5))
    rng.shuffle(free)  # scattered, out-of-order pages
    cache = PagedKVCache.for_model(loaded.config, len(free), BLOCK_SIZE, dtype)
    tracks = [
        Track(p, tuple(free[i * pages_each : (i + 1) * pages_each]), rows={}) for i, p in enumerate(prompts)
    ]
    # step 1: the longest prompt only partly (chunked prefill); step 2: its rest mixed with decodes
    first = [len(t.tokens) for t in tracks]
    first[-1] = 9
    _step(loaded.model, cache, tracks, first)
    for _ in range(decode_steps):
        _step(loaded.model, cache, tracks, [len(t.tokens) for t in tracks])
    return tracks


def _check(path: Path, dtype: torch.dtype, atol: float) -> None:
    tracks = _run_ours(path, dtype, decode_steps=4)
    assert all(len(t.rows or {}) == len(t.tokens) - 1 for t in tracks)  # every position was produced
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        for track in tracks:
            assert track.rows is not None
            positions = sorted(track.rows)
            ref = hf(torch.tensor([track.tokens[: positions[-1] + 1]])).logits[0].float()
            ours = torch.stack([track.rows[p] for p in positions])
            torch.testing.assert_close(ours, ref[positions], atol=atol, rtol=0)
            top2 = ref[positions].topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * atol
            assert torch.equal(ours.argmax(-1)[clear], ref[positions].argmax(-1)[clear])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant: str, tiny_model_factory: Callable[..., Path]) -> None:
    overrides = VARIANTS[variant]
    path = tiny_model_factory(**overrides)
    dtype = getattr(torch, str(overrides.get("dtype", "float32")))
    _check(path, dtype, atol=1e-4 if dtype == torch.float32 else 6e-2)


def test_layer_by_layer_equals_forward(tiny_llama: Path) -> None:
    """embed + layer_forward per layer + head gives exactly what forward + head gives."""
    loaded = load_model(tiny_llama, torch.float32)
    seqs = [SeqSlice((3, 1), 0, 6), SeqSlice((0, 2), 0, 5)]
    ids = torch.arange(3, 14)
    model = loaded.model
    cache_a = PagedKVCache.for_model(loaded.config, 4, BLOCK_SIZE, torch.float32)
    cache_b = PagedKVCache.for_model(loaded.config, 4, BLOCK_SIZE, torch.float32)
    whole = model.head(model(ids, AttentionContext.build(cache_a, seqs, loaded.config)))
    ctx = AttentionContext.build(cache_b, seqs, loaded.config)
    hidden = model.embed(ids)
    for index in range(loaded.config.num_layers):
        hidden = model.layer_forward(index, hidden, ctx)
    assert torch.equal(model.head(hidden), whole)
    assert torch.equal(cache_a.tensor, cache_b.tensor)


@pytest.mark.parametrize("variant", ["llama", "qwen2-bias-window"])
def test_equal_length_prompts_match_transformers(
    variant: str, tiny_model_factory: Callable[..., Path]
) -> None:
    """Equal-length prompts take the unpadded causal path (with the window mask where one applies)."""
    path = tiny_model_factory(**VARIANTS[variant])
    loaded = load_model(path, torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, loaded.config.vocab_size, (3, 11), generator=g)
    cache = PagedKVCache.for_model(loaded.config, 12, BLOCK_SIZE, torch.float32)
    seqs = [SeqSlice((3 * i + 2, 3 * i, 3 * i + 1), 0, 11) for i in range(3)]
    ours = loaded.model.head(
        loaded.model(prompts.reshape(-1), AttentionContext.build(cache, seqs, loaded.config))
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(prompts).logits.reshape(33, -1)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_long_prompt_then_decode_match_transformers(tiny_model_factory: Callable[..., Path]) -> None:
    """Positions past the first RoPE table size (256), 16-token pages, a resumed chunk, then decodes."""
    path = tiny_model_factory(**VARIANTS["mistral-window"])
    loaded = load_model(path, torch.float32)
    model, config = loaded.model, loaded.config
    tokens = torch.randint(3, config.vocab_size, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    cache = PagedKVCache.for_model(config, 40, 16, torch.float32)
    pages = tuple(range(39, 0, -2))  # 20 scattered pages: room for 320 tokens
    rows = []
    for start, stop in ((0, 200), (200, 300)):
        ctx = AttentionContext.build(cache, [SeqSlice(pages, start, stop - start)], config)
        rows.append(model.head(model(torch.tensor(tokens[start:stop]), ctx)))
    for _ in range(3):
        tokens.append(int(rows[-1][-1].argmax()))
        ctx = AttentionContext.build(cache, [SeqSlice(pages, len(tokens) - 1, 1)], config)
        rows.append(model.head(model(torch.tensor(tokens[-1:]), ctx)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.cat(rows), ref, atol=1e-4, rtol=0)
