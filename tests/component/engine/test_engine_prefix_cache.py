"""The engine's automatic prefix cache against transformers' greedy `generate`, token for token.

Per architecture, with the cache on and off: prompts sharing a system prefix that ends mid-page (in
one batch and in later batches), two turns of one conversation (the second prompt extends the first
turn's prompt and answer), and a cache so small that later prompts evict earlier pages. Every token
equals transformers'; a prefill reports the prompt tokens it took from the cache; afterwards every
page is free or cached and the block manager's invariants hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from replica.config import ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.types import BatchId, BatchSpec, DecodeInput, RequestId, RequestSpec, StoppingParams
from tests.helpers.engine_driver import reference_greedy

BLOCK = 4
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "mistral": {"arch": "mistral", "kv_heads": 1, "sliding_window": 24},
    "qwen2": {"arch": "qwen2", "tie_embeddings": True},
}


class _Runner:
    """Runs batches to completion one after the other, as a router would, recording what came back."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.next_id = 0
        self.cached: dict[int, int] = {}
        self.evicted: list[int] = []

    def run(self, prompts: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
        first = self.next_id
        self.next_id += len(prompts)
        specs = tuple(
            RequestSpec(RequestId(first + i), tuple(p), stopping=StoppingParams(max_new_tokens=max_new))
            for i, p in enumerate(prompts)
        )
        tokens: dict[int, list[int]] = {first + i: [] for i in range(len(prompts))}
        result = self.engine.prefill(BatchSpec(BatchId(first + 1), specs))
        for g in result.generations:
            self.cached[g.request_id] = g.cached_tokens
        while True:
            self.evicted.extend(result.evicted_page_hashes)
            for g in result.generations:
                tokens[g.request_id].extend(g.tokens.ids)
            if result.batch is None:
                break
            result = self.engine.decode([DecodeInput(result.batch.id)])
        return [tokens[first + i] for i in range(len(prompts))]


def _prompts(vocab: int) -> dict[str, list[list[int]]]:
    gen = torch.Generator().manual_seed(5)

    def rand(n: int) -> list[int]:
        return list(torch.randint(3, vocab, (n,), generator=gen).tolist())

    system = rand(11)  # two full pages and three tokens of a third
    return {
        "first": [system + rand(3), system + rand(6)],
        "again": [system + rand(5), system + rand(2), system[:9]],  # the last: a prefix of a prefix
        "other": [rand(17), rand(9)],
    }


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prefix_cache_matches_transformers(
    tiny_model_factory: Callable[..., Path], arch: str, prefix_cache: bool
) -> None:
    path = tiny_model_factory(**ARCHS[arch])
    config = ReplicaConfig(model=path, port=0, num_blocks=24, block_size=BLOCK, prefix_cache=prefix_cache)
    engine = build_engine(config)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    runner = _Runner(engine)
    prompts = _prompts(engine.limits.vocab_size)
    max_new = 5

    def check(batch: list[list[int]], got: list[list[int]]) -> None:
        for prompt, tokens in zip(batch, got, strict=True):
            assert tokens == reference_greedy(hf, prompt, max_new)[0], f"{arch}: prompt {prompt}"

    check(prompts["first"], runner.run(prompts["first"], max_new))
    # full pages with K/V: 14 + 4 and 17 + 4 tokens hold 4 + 5 pages, the system prompt's two counted once
    assert engine.info().num_blocks_cached == (7 if prefix_cache else 0)
    assert runner.cached[1] == (8 if prefix_cache else 0)  # the system prompt computed once in the batch
    check(prompts["again"], runner.run(prompts["again"], max_new))
    shared = [runner.cached[i] for i in (2, 3, 4)]
    assert shared == ([8, 8, 8] if prefix_cache else [0, 0, 0])  # the third: its last token computed

    # n samples of one prompt (sent as n requests): its full pages are computed once
    samples = [prompts["other"][0][:13]] * 3
    check(samples, runner.run(samples, max_new))
    assert [runner.cached[runner.next_id - 3 + i] for i in range(3)] == (
        [0, 12, 12] if prefix_cache else [0] * 3
    )

    # two turns of one conversation: the second prompt carries the first one's answer
    turn1 = prompts["first"][1] + [7, 8, 9]
    [answer] = runner.run([turn1], max_new)
    check([turn1], [answer])
    turn2 = turn1 + answer + [10, 11]
    check([turn2], runner.run([turn2], max_new))
    # every page the first turn's prompt and answer filled (their K/V written) came back from the cache
    reused = (len(turn1) + max_new - 1) // BLOCK * BLOCK
    assert runner.cached[runner.next_id - 1] == (reused if prefix_cache else 0)

    # eviction under pressure: 24 pages cannot keep everything; later prompts evict earlier pages
    check(prompts["other"], runner.run(prompts["other"], max_new))
    long = [prompts["other"][0] + prompts["other"][1] + prompts["first"][0]]
    check(long, runner.run(long, max_new))
    check(prompts["again"], runner.run(prompts["again"], max_new))
    assert (len(runner.evicted) > 0) is prefix_cache

    blocks = engine.blocks
    blocks.check()
    assert (blocks.num_used, blocks.num_free, len(engine.store)) == (0, blocks.num_blocks, 0)
    info = engine.info()
    assert info.prefix_cache is prefix_cache and len(info.cached_page_hashes) == info.num_blocks_cached


def test_unloaded_weights_drop_the_cache(tiny_model_factory: Callable[..., Path]) -> None:
    """K/V computed before ResetStatus may not match the weights loaded after it: nothing is shared."""
    path = tiny_model_factory(**ARCHS["llama"])
    engine = build_engine(ReplicaConfig(model=path, port=0, num_blocks=24, block_size=BLOCK))
    runner = _Runner(engine)
    prompt = list(range(3, 20))
    first = runner.run([prompt], 2)
    assert runner.run([prompt], 2) == first and runner.cached[1] == 16
    hashes = set(engine.info().cached_page_hashes)
    engine.readiness.reset()
    engine.readiness.mark_all()  # the same weights again, as far as this test goes
    assert runner.run([prompt], 2) == first and runner.cached[2] == 0
    assert hashes <= set(runner.evicted)  # the router's index forgets them
    engine.blocks.check()
