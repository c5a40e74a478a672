"""Chunked prefill: a batch over `--max-batch-prefill-tokens` runs as consecutive forwards.

Prompts of 1-45 tokens with a 16-token chunk: every forward feeds at most 16 tokens, and the tokens
equal the unchunked engine's and transformers' greedy `generate` (llama, mistral with a sliding
window shorter than the prompts, qwen2), with the prefix cache on and off; a request asking for
prompt log-probabilities is computed whole and gets one log-probability per prompt token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from replica.config import ReplicaConfig
from replica.engine.backend import SeqInput
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.types import BatchId, BatchSpec, DecodeInput, RequestId, RequestSpec, StoppingParams
from tests.helpers.engine_driver import reference_greedy

CHUNK = 16
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "mistral": {"arch": "mistral", "kv_heads": 1, "sliding_window": 12},
    "qwen2": {"arch": "qwen2", "tie_embeddings": True},
}


def _count_forwards(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens each forward of `engine` feeds, appended as they run."""
    fed: list[int] = []
    forward = engine.runner.forward

    def counting(inputs: list[SeqInput]) -> Any:
        fed.append(sum(len(i.tokens) for i in inputs))
        return forward(inputs)

    monkeypatch.setattr(engine.runner, "forward", counting)
    return fed


def _generate(engine: Engine, specs: Sequence[RequestSpec], batch_id: int) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {int(s.id): [] for s in specs}
    result = engine.prefill(BatchSpec(BatchId(batch_id), tuple(specs)))
    while True:
        for g in result.generations:
            tokens[g.request_id].extend(g.tokens.ids)
        if result.batch is None:
            return tokens
        result = engine.decode([DecodeInput(result.batch.id)])


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_chunked_prefill_equals_unchunked_and_transformers(
    tiny_model_factory: Callable[..., Path], arch: str, prefix_cache: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_factory(**ARCHS[arch])
    config = ReplicaConfig(
        model=path,
        port=0,
        num_blocks=64,
        block_size=4,
        max_batch_prefill_tokens=CHUNK,
        prefix_cache=prefix_cache,
    )
    engine = build_engine(config)
    fed = _count_forwards(engine, monkeypatch)
    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, engine.limits.vocab_size, (n,), generator=gen).tolist() for n in (45, 1, 17, 30)
    ]
    max_new = 4
    specs = [
        RequestSpec(RequestId(i), tuple(p), stopping=StoppingParams(max_new_tokens=max_new))
        for i, p in enumerate(prompts)
    ]
    chunked = _generate(engine, specs, 1)
    assert len(fed) > 1 + max_new and all(n <= CHUNK for n in fed)  # the prefill ran as several forwards

    whole = build_engine(ReplicaConfig(model=path, port=0, num_blocks=64, block_size=4, prefix_cache=False))
    assert _generate(whole, specs, 1) == chunked
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        assert chunked[i] == reference_greedy(hf, prompt, max_new)[0], f"{arch}: prompt of {len(prompt)}"

    # prompt log-probabilities: that request is computed in one piece, the others still chunked
    logprob_spec = RequestSpec(
        RequestId(10), tuple(prompts[0]), stopping=StoppingParams(max_new_tokens=1), prefill_logprobs=True
    )
    other = RequestSpec(RequestId(11), tuple(prompts[3]), stopping=StoppingParams(max_new_tokens=1))
    result = engine.prefill(BatchSpec(BatchId(2), (logprob_spec, other)))
    [with_logprobs] = [g for g in result.generations if g.request_id == 10]
    assert with_logprobs.prefill_tokens is not None and len(with_logprobs.prefill_tokens.ids) == len(
        prompts[0]
    )
    assert with_logprobs.tokens.ids[0] == chunked[0][0]
    if result.batch is not None:
        engine.clear(result.batch.id)

    # two samples of one new prompt: with the cache the first computes the shared pages in chunks first
    fresh = torch.randint(3, engine.limits.vocab_size, (37,), generator=gen).tolist()
    twins = [
        RequestSpec(RequestId(20 + i), tuple(fresh), stopping=StoppingParams(max_new_tokens=max_new))
        for i in range(2)
    ]
    fed.clear()
    result = engine.prefill(BatchSpec(BatchId(3), tuple(twins)))
    assert [g.cached_tokens for g in result.generations] == ([0, 36] if prefix_cache else [0, 0])
    assert all(n <= CHUNK for n in fed)
    got: dict[int, list[int]] = {20: [], 21: []}
    while True:
        for g in result.generations:
            got[g.request_id].extend(g.tokens.ids)
        if result.batch is None:
            break
        result = engine.decode([DecodeInput(result.batch.id)])
    want = reference_greedy(hf, fresh, max_new)[0]
    assert got == {20: want, 21: want}
    blocks = engine.blocks
    blocks.check()
    assert (blocks.num_used, blocks.num_free) == (0, blocks.num_blocks)


def test_one_chunk_per_call_interleaves_with_another_batchs_decode_steps(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefill(chunk_tokens=)` + `prefill_chunk`: each call at most one forward of the chunk; the
    batch is prefilling (no tokens, no decode, no migration) until its last chunk; tokens equal
    transformers; a cleared prefilling batch gives every page back."""
    from replica.errors import FailedPrecondition, InvalidArgument
    from replica.migration.manager import take_for_migration

    path = tiny_model_factory(arch="llama")
    engine = build_engine(ReplicaConfig(model=path, port=0, num_blocks=64, block_size=4))
    fed = _count_forwards(engine, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    vocab = engine.limits.vocab_size
    long_prompt, short, fresh = (torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (45, 6, 40))
    stop = StoppingParams(max_new_tokens=4)

    def batch(batch_id: int, prompt: list[int]) -> BatchSpec:
        return BatchSpec(BatchId(batch_id), (RequestSpec(RequestId(batch_id), tuple(prompt), stopping=stop),))

    running = engine.prefill(batch(1, short))
    got: dict[int, list[int]] = {1: list(running.generations[0].tokens.ids), 2: []}
    assert running.batch is not None
    result = engine.prefill(batch(2, long_prompt), chunk_tokens=CHUNK)
    calls = 1
    while not result.generations:
        assert result.batch is not None and fed[-1] <= CHUNK
        with pytest.raises(FailedPrecondition, match="prefilled in chunks"):
            engine.decode([DecodeInput(BatchId(2))])
        with pytest.raises(FailedPrecondition, match="prefilled in chunks"):
            take_for_migration(engine, BatchSpec(BatchId(2), ()))
        if running.batch is not None:  # the other batch steps between the chunks
            running = engine.decode([DecodeInput(running.batch.id)])
            got[1].extend(t for g in running.generations for t in g.tokens.ids)
        fed.clear()
        result = engine.prefill_chunk(BatchId(2), CHUNK)
        assert len(fed) <= 1
        calls += 1
    assert calls == 3  # 45 tokens: 16 + 16, then 13 in the sampling forward
    got[2].extend(result.generations[0].tokens.ids)
    while result.batch is not None:
        result = engine.decode([DecodeInput(result.batch.id)])
        got[2].extend(t for g in result.generations for t in g.tokens.ids)
    while running.batch is not None:
        running = engine.decode([DecodeInput(running.batch.id)])
        got[1].extend(t for g in running.generations for t in g.tokens.ids)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    assert got == {1: reference_greedy(hf, short, 4)[0], 2: reference_greedy(hf, long_prompt, 4)[0]}

    ordinary = engine.prefill(batch(3, short))
    assert ordinary.batch is not None
    with pytest.raises(FailedPrecondition, match="not being prefilled"):
        engine.prefill_chunk(BatchId(3), CHUNK)
    with pytest.raises(InvalidArgument, match="chunk_tokens"):
        engine.prefill_chunk(BatchId(3), 0)
    engine.clear(BatchId(3))
    half = engine.prefill(batch(4, fresh), chunk_tokens=CHUNK)
    assert not half.generations and half.batch is not None
    engine.clear(BatchId(4))  # a prefilling batch given up: every page back
    engine.blocks.check()
    assert engine.blocks.num_used == 0 and engine.blocks.num_free == engine.blocks.num_blocks
