"""Decode through captured CUDA graphs equals the eager path token for token (float32, TF32 off), at
batch sizes on and off the graph buckets: each batch's requests end at different lengths, so its
steps run with every row count from the batch size down to 1 (padded up to the next bucket).
Skips without a CUDA device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from replica.config import DType
from replica.engine.engine import Engine
from replica.engine.types import RequestId, RequestSpec, StoppingParams
from tests.helpers.cuda_engines import CUDA_REASON, cuda_engine, random_prompts, run_to_end, tf32_off

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)

DEVICE = "cuda"
LLAMA: dict[str, Any] = {"arch": "llama", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2,
                         "intermediate": 512}
BATCHES = (1, 3, 8, 13, 40)  # 3, 13 and 40 are no bucket (cuda_graphs.BUCKETS)


def _specs(batch: int, vocab: int) -> list[RequestSpec]:
    prompts = random_prompts(batch, vocab, seed=batch)
    return [RequestSpec(RequestId(i), tuple(p), stopping=StoppingParams(max_new_tokens=2 + (i * 3) % 17,
                                                                        ignore_eos=True))
            for i, p in enumerate(prompts)]


def _count_replays(engine: Engine) -> list[int]:
    """A counter of the steps the engine's decode graphs serve (fails when it has none)."""
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    assert graphs is not None and graphs.captured, "no decode graphs were captured"
    calls = [0]
    run = graphs.run

    def counted(seqs: Any) -> Any:
        calls[0] += 1
        return run(seqs)

    graphs.run = counted
    return calls


def test_graph_decode_equals_eager_decode(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory(**LLAMA)
    with tf32_off():
        graphed = cuda_engine(path, DType.FLOAT32, num_blocks=600, device=DEVICE, cuda_graphs=True)
        eager = cuda_engine(path, DType.FLOAT32, num_blocks=600, device=DEVICE, cuda_graphs=False)
        assert graphed.meta.cuda_graphs and not eager.meta.cuda_graphs
        assert graphed.meta.attention_backend == eager.meta.attention_backend
        replays = _count_replays(graphed)
        free = graphed.blocks.num_free, eager.blocks.num_free
        for batch in BATCHES:
            specs = _specs(batch, graphed.limits.vocab_size)
            want = run_to_end(eager, batch, specs)
            got = run_to_end(graphed, batch, specs)
            assert got == want, f"batch {batch}: graph decode differs from eager"
        assert replays[0] >= sum(max(2 + (i * 3) % 17 for i in range(b)) - 1 for b in BATCHES)
        assert (graphed.blocks.num_free, eager.blocks.num_free) == free
