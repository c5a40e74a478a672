"""Shared by the tests of `tests/gpu`: an engine on CUDA from a tiny checkpoint, a batch of request
specs run to the end, and float32 math with TF32 off (so the engine and transformers compute the
same numbers on the GPU)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from replica.config import DType, ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.types import BatchId, BatchSpec, DecodeInput, RequestSpec

CUDA_REASON = "needs a CUDA device (torch.cuda.is_available() is False)"


def cuda_engine(path: Path, dtype: DType | None = DType.FLOAT32, num_blocks: int = 400, block_size: int = 8,
                device: str = "cuda", **overrides: Any) -> Engine:
    """The engine on `device` (graphs and attention backend at their defaults unless overridden)."""
    config = ReplicaConfig(model=path, port=0, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                           device=device)
    return build_engine(replace(config, **overrides))


@contextmanager
def tf32_off() -> Iterator[None]:
    """float32 matmuls and convolutions in full float32 while inside."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def run_to_end(engine: Engine, batch_id: int, specs: Sequence[RequestSpec]) -> dict[int, list[int]]:
    """Prefill `specs` as one batch and decode until every request finished; each request's tokens.
    (Finished requests are skipped by decode; the engine drops the batch, pages and all, once all are.)"""
    tokens: dict[int, list[int]] = {int(s.id): [] for s in specs}
    result = engine.prefill(BatchSpec(BatchId(batch_id), tuple(specs)))
    while True:
        for g in result.generations:
            tokens[int(g.request_id)].extend(g.tokens.ids)
        if result.batch is None:
            return tokens
        result = engine.decode([DecodeInput(result.batch.id)])


def random_prompts(count: int, vocab: int, seed: int, longest: int = 40) -> list[list[int]]:
    """`count` prompts of 1..`longest` random token ids (never the special ids 0-2)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1 + (i * 7) % longest,), generator=gen).tolist() for i in range(count)]
