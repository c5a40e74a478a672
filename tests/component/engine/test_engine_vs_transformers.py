"""The engine against transformers' greedy `generate`, token for token, on tiny checkpoints.

Per architecture: 24 prompts of mixed lengths (1-40 tokens) with different max_new_tokens arrive in
three prefill batches; the running batch is merged with each new one and finished requests are
filtered out between steps, as a router would. Every generated token must equal transformers' and
every chosen token's log-probability must be within 1e-4 of transformers' (float32).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from replica.config import ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.types import (
    BatchId,
    BatchSpec,
    CachedBatchInfo,
    DecodeInput,
    RequestId,
    RequestSpec,
    StepResult,
    StoppingParams,
)

LOGPROB_ATOL = 1e-4
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "mistral": {"arch": "mistral", "kv_heads": 1, "sliding_window": 24},
    "qwen2": {"arch": "qwen2", "tie_embeddings": True},
}


def _workload(vocab: int, count: int = 24) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(11)
    work = []
    for i in range(count):
        length = 1 + (i * 7) % 40
        prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
        work.append((prompt, 1 + (i * 5) % 12))
    return work


def _reference(hf: Any, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


class Driver:
    """Drives an engine like a router: prefill, merge into the running batch, filter finished requests."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.running: CachedBatchInfo | None = None
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}

    def _collect(self, result: StepResult) -> CachedBatchInfo | None:
        finished = []
        for g in result.generations:
            self.tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
            self.logprobs.setdefault(g.request_id, []).extend(g.tokens.logprobs)
            if g.generated_text is not None:
                finished.append(g.request_id)
        batch = result.batch
        if batch is not None and finished:
            keep = [r for r in batch.request_ids if r not in finished]
            batch = self.engine.filter(batch.id, keep) if keep else None
            if not keep:
                assert batch is None
        return batch if batch is None or batch.size else None

    def prefill(self, batch_id: int, first_id: int, work: list[tuple[list[int], int]]) -> None:
        requests = tuple(
            RequestSpec(RequestId(first_id + i), tuple(p), stopping=StoppingParams(max_new_tokens=n))
            for i, (p, n) in enumerate(work)
        )
        new = self._collect(self.engine.prefill(BatchSpec(BatchId(batch_id), requests)))
        inputs = [b for b in (self.running, new) if b is not None]
        self.running = self._step([DecodeInput(b.id) for b in inputs]) if inputs else None

    def _step(self, inputs: list[DecodeInput]) -> CachedBatchInfo | None:
        return self._collect(self.engine.decode(inputs))

    def decode(self, steps: int) -> None:
        for _ in range(steps):
            if self.running is not None:
                self.running = self._step([DecodeInput(self.running.id)])


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_engine_matches_transformers_greedy(tiny_model_factory: Callable[..., Path], arch: str) -> None:
    path = tiny_model_factory(**ARCHS[arch])
    engine = build_engine(ReplicaConfig(model=path, port=0, num_blocks=200, block_size=8))
    total_free = engine.blocks.num_free
    work = _workload(engine.limits.vocab_size)
    driver = Driver(engine)
    driver.prefill(1, 0, work[:10])
    driver.decode(2)
    driver.prefill(2, 10, work[10:18])
    driver.decode(1)
    driver.prefill(3, 18, work[18:])
    driver.decode(20)
    assert driver.running is None and len(engine.store) == 0
    assert engine.blocks.num_free == total_free

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for rid, (prompt, max_new) in enumerate(work):
        tokens, logprobs = _reference(hf, prompt, max_new)
        assert driver.tokens[rid] == tokens, f"{arch} request {rid} (prompt {len(prompt)} tokens)"
        assert driver.logprobs[rid] == pytest.approx(logprobs, abs=LOGPROB_ATOL)
