"""The replica engine run in this process, no gRPC and no router: the ceiling the cluster is compared to.

One batch of `batch_size` requests (`input_len` random prompt tokens, exactly `output_len` new
tokens, greedy, EOS ignored) is prefilled, then decoded step by step until every request is done;
after a warm-up, `repeats` times, keeping the fastest. Decode tokens/s counts the tokens of the
decode steps over their wall time.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BaselineResult:
    """Prefill and decode throughput of one in-process batch."""

    batch_size: int
    input_len: int
    output_len: int
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int
    decode_steps: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second over the decode steps."""
        return self.decode_tokens / max(self.decode_seconds, 1e-9)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of the prefill."""
        return self.batch_size * self.input_len / max(self.prefill_seconds, 1e-9)


def run_engine_baseline(
    model: Path,
    batch_size: int,
    input_len: int,
    output_len: int,
    block_size: int = 16,
    seed: int = 0,
    repeats: int = 3,
    threads: int = 0,
) -> BaselineResult:
    """Prefill one batch and decode it to the end on an in-process engine; the best of `repeats` runs."""
    import torch

    from replica.config import ReplicaConfig
    from replica.engine.factory import build_engine

    if threads:
        torch.set_num_threads(threads)  # as many as one replica of the cluster gets
    from replica.engine.types import BatchId, RequestId, RequestSpec, StoppingParams

    pages_per_request = -(-(input_len + output_len) // block_size)
    config = ReplicaConfig(
        model=model, port=0, num_blocks=batch_size * pages_per_request + 8, block_size=block_size
    )
    engine = build_engine(config)
    rng = random.Random(seed)
    vocab = engine.limits.vocab_size
    requests = tuple(
        RequestSpec(
            id=RequestId(i),
            input_tokens=tuple(rng.randrange(3, vocab) for _ in range(input_len)),
            stopping=StoppingParams(max_new_tokens=output_len, ignore_eos=True),
        )
        for i in range(batch_size)
    )
    _warm_up(engine, requests[0])
    runs = [_measure(engine, requests, BatchId(2 + r)) for r in range(max(1, repeats))]
    # The best run is the ceiling: the others lost time to whatever else shares the CPU.
    prefill_s, decode_s, tokens, steps = min(runs, key=lambda run: run[1] / max(run[2], 1))
    return BaselineResult(batch_size, input_len, output_len, prefill_s, decode_s, tokens, steps)


def _measure(engine: Any, requests: tuple[Any, ...], batch_id: Any) -> tuple[float, float, int, int]:
    """(prefill seconds, decode seconds, decode tokens, decode steps) of one batch run to the end."""
    from replica.engine.types import BatchSpec, DecodeInput

    start = time.perf_counter()
    result = engine.prefill(BatchSpec(id=batch_id, requests=requests))
    prefilled = time.perf_counter()
    tokens = steps = 0
    while result.batch is not None:
        result = engine.decode([DecodeInput(batch_id=result.batch.id)])
        tokens += sum(len(g.tokens.ids) for g in result.generations)
        steps += 1
    return prefilled - start, time.perf_counter() - prefilled, tokens, steps


def _warm_up(engine: Any, request: Any) -> None:
    """A short prefill + decode first: the first calls pay torch's lazy initialisation."""
    from replica.engine.types import BatchId, BatchSpec, DecodeInput

    result = engine.prefill(BatchSpec(id=BatchId(1), requests=(request,)))
    for _ in range(2):
        if result.batch is None:
            return
        result = engine.decode([DecodeInput(batch_id=result.batch.id)])
    if result.batch is not None:
        engine.clear(result.batch.id)
