"""The replica engine run in this process, no gRPC and no router: the ceiling the cluster is compared to.

One batch of `batch_size` requests (`input_len` random prompt tokens, exactly `output_len` new
tokens, greedy, EOS ignored) is prefilled, then decoded step by step until every request is done;
after a warm-up, `repeats` times, keeping the fastest. Decode tokens/s counts the tokens of the
decode steps over their wall time.

The prefill is cut into batches as the router's batcher cuts its queue (`router/queue.py`: the FIFO
prefix under the prompt-token and batch-size budgets, a head request alone past the token budget
still taken); the decode then steps all of them merged into one batch, as a decode replica does.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def router_default(name: str) -> int:
    """The default of a `pdcluster router` flag (the budgets its batcher cuts prefill batches by)."""
    from router.config import RouterConfig

    default = next(f.default for f in dataclasses.fields(RouterConfig) if f.name == name)
    if not isinstance(default, int):
        raise TypeError(f"router flag {name} has no integer default")
    return default


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


def prefill_groups(prompt_lens: Sequence[int], max_prefill_tokens: int, max_batch_size: int) -> list[range]:
    """Consecutive index ranges, each one prefill batch: the longest FIFO prefix within
    `max_prefill_tokens` prompt tokens and `max_batch_size` requests (at least one request)."""
    groups: list[range] = []
    start = 0
    while start < len(prompt_lens):
        end, tokens = start, 0
        while (end < len(prompt_lens) and end - start < max_batch_size
               and (end == start or tokens + prompt_lens[end] <= max_prefill_tokens)):
            tokens += prompt_lens[end]
            end += 1
        groups.append(range(start, end))
        start = end
    return groups


def run_engine_baseline(
    model: Path,
    batch_size: int,
    input_len: int,
    output_len: int,
    block_size: int = 16,
    seed: int = 0,
    repeats: int = 3,
    threads: int = 0,
    max_batch_size: int = 0,
) -> BaselineResult:
    """Prefill one batch and decode it to the end on an in-process engine; the best of `repeats` runs."""
    if threads:
        import torch

        torch.set_num_threads(threads)  # as many as one replica of the cluster gets
    round_ = build_baseline(model, batch_size, input_len, output_len, block_size, seed, max_batch_size)
    runs = [round_.measure() for _ in range(max(1, repeats))]
    # The best run is the ceiling: the others lost time to whatever else shares the CPU.
    prefill_s, decode_s, tokens, steps = min(runs, key=lambda run: run[1] / max(run[2], 1))
    return BaselineResult(batch_size, input_len, output_len, prefill_s, decode_s, tokens, steps)


class BaselineRound:
    """An engine built and warmed up once; each call prefills and decodes the batch again."""

    def __init__(self, engine: Any, batches: list[tuple[Any, ...]], input_len: int) -> None:
        self.engine, self.batches, self.input_len = engine, batches, input_len
        self.next_id = 2  # batch id 1 was the warm-up's

    def measure(self) -> tuple[float, float, int, int]:
        """(prefill seconds, decode seconds, decode tokens, decode steps) of one run."""
        first, self.next_id = self.next_id, self.next_id + len(self.batches)
        return _measure(self.engine, self.batches, first)

    def __call__(self) -> dict[str, float]:
        """One run as rates: decode tokens/s and prefill tokens/s."""
        prefill_s, decode_s, tokens, _ = self.measure()
        prompt_tokens = sum(len(batch) for batch in self.batches) * self.input_len
        return {"decode_tokens_per_s": tokens / decode_s, "prefill_tokens_per_s": prompt_tokens / prefill_s}


def build_baseline(
    model: Path,
    batch_size: int,
    input_len: int,
    output_len: int,
    block_size: int = 16,
    seed: int = 0,
    max_batch_size: int = 0,
    prefix_cache: bool = True,
    cpu_onednn: bool = True,
) -> BaselineRound:
    """An in-process engine for one batch of random prompts, cut into prefill batches as the router
    cuts them. Every run sends the same prompts: `prefix_cache=False` keeps a later run from finding
    them cached (a prefill figure that computes every prompt token)."""
    from replica.config import ReplicaConfig
    from replica.engine.factory import build_engine
    from replica.engine.types import RequestId, RequestSpec, StoppingParams

    pages_per_request = -(-(input_len + output_len) // block_size)
    config = ReplicaConfig(
        model=model,
        port=0,
        num_blocks=batch_size * pages_per_request + 8,
        block_size=block_size,
        prefix_cache=prefix_cache,
        cpu_onednn=cpu_onednn,
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
    budget = min(engine.limits.max_prefill_tokens, router_default("max_batch_prefill_tokens"))
    per_batch = max_batch_size or router_default("max_batch_size")
    groups = prefill_groups([input_len] * batch_size, budget, per_batch)
    return BaselineRound(engine, [tuple(requests[i] for i in group) for group in groups], input_len)


def _measure(engine: Any, batches: list[tuple[Any, ...]], first_id: int) -> tuple[float, float, int, int]:
    """(prefill seconds, decode seconds, decode tokens, decode steps) of the batches prefilled one
    after another, then decoded merged until every request is done."""
    from replica.engine.types import BatchId, BatchSpec, DecodeInput

    start = time.perf_counter()
    cached = []
    for offset, requests in enumerate(batches):
        result = engine.prefill(BatchSpec(id=BatchId(first_id + offset), requests=requests))
        if result.batch is not None:
            cached.append(result.batch.id)
    prefilled = time.perf_counter()
    tokens = steps = 0
    while cached:
        result = engine.decode([DecodeInput(batch_id=batch_id) for batch_id in cached])
        tokens += sum(len(g.tokens.ids) for g in result.generations)
        steps += 1
        cached = [result.batch.id] if result.batch is not None else []
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
