"""Drive an engine the way a router does, and ask transformers for the greedy reference.

Shared by the engine-against-transformers tests: `Driver` prefills batches, merges each new batch into
the running one and filters finished requests between steps; `reference_greedy` is transformers'
greedy `generate` of one prompt alone, with each chosen token's log-probability.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from replica.engine.engine import Engine
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


def reference_greedy(
    hf: Any, prompt: Sequence[int], max_new: int, ignore_eos: bool = False
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for `prompt` alone (exactly `max_new` with `ignore_eos`), and each
    one's log-probability."""
    out = hf.generate(
        torch.tensor([list(prompt)]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        min_new_tokens=max_new if ignore_eos else None,
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


def run_mixed_schedule(driver: Driver, work: list[tuple[list[int], int]]) -> None:
    """The engine-vs-transformers schedule over 24 requests: three prefill batches merged into the
    running batch between decode steps, then decode until every request finished."""
    driver.prefill(1, 0, work[:10])
    driver.decode(2)
    driver.prefill(2, 10, work[10:18])
    driver.decode(1)
    driver.prefill(3, 18, work[18:])
    driver.decode(20)
