"""The shared engine over a `SimRunner`: modelled time per step, deterministic tokens, the real
engine's page accounting and refusals, the scaled buffers — no torch, no checkpoint."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable

import pytest

from replica.config import EngineKind, ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.sim.clock import TallyClock
from replica.engine.sim.cost import Fed, Roofline
from replica.engine.sim.factory import build_simulated
from replica.engine.sim.gpus import gpu
from replica.engine.sim.runner import SimRunner
from replica.engine.types import (
    BatchId,
    BatchSpec,
    DecodeInput,
    RequestId,
    RequestSpec,
    SamplingParams,
    StoppingParams,
)
from replica.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

BLOCK = 16


def _build(**overrides: object) -> tuple[Engine, TallyClock]:
    base: dict[str, object] = {"port": 0, "engine": EngineKind.SIMULATED, "gpu": "a100-80g",
                               "model_card": "llama-2-7b", "num_blocks": 64, "block_size": BLOCK,
                               "byte_scale": "1/1024", **overrides}
    clock = TallyClock()
    engine, _ = build_simulated(ReplicaConfig(**base), clock)  # type: ignore[arg-type]
    return engine, clock


@pytest.fixture
def sim() -> tuple[Engine, TallyClock]:
    return _build()


def _req(rid: int, prompt: list[int], max_new: int = 4, **kwargs: object) -> RequestSpec:
    return RequestSpec(RequestId(rid), tuple(prompt), stopping=StoppingParams(max_new_tokens=max_new),
                       **kwargs)  # type: ignore[arg-type]


def _run(engine: Engine, batch_id: int, requests: list[RequestSpec]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    result = engine.prefill(BatchSpec(BatchId(batch_id), tuple(requests)))
    while True:
        for g in result.generations:
            out.setdefault(g.request_id, []).extend(g.tokens.ids)
        if result.batch is None:
            return out
        result = engine.decode([DecodeInput(result.batch.id)])


NO_TORCH = """
import sys
from replica.config import EngineKind, ReplicaConfig
from replica.engine.backends import build_engine_and_params
from replica.engine.types import BatchId, BatchSpec, RequestId, RequestSpec, StoppingParams
engine, _ = build_engine_and_params(ReplicaConfig(port=0, engine=EngineKind.SIMULATED, num_blocks=8))
request = RequestSpec(RequestId(1), (5, 6, 7), stopping=StoppingParams(max_new_tokens=2))
assert engine.prefill(BatchSpec(BatchId(1), (request,))).generations
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
"""


def test_a_simulated_engine_imports_no_torch() -> None:
    subprocess.run([sys.executable, "-c", NO_TORCH], check=True, timeout=120)


def test_info_says_simulated(sim: tuple[Engine, TallyClock]) -> None:
    engine, _ = sim
    info = engine.info()
    assert info.device_type == "simulated:a100-80g"
    assert (info.num_layers, info.block_size, info.num_blocks_total) == (32, BLOCK, 64)
    assert info.dtype == "bfloat16"


def test_each_step_takes_the_roofline_time(sim: tuple[Engine, TallyClock]) -> None:
    engine, clock = sim
    cost = Roofline(engine.runner.config, 2, gpu("a100-80g"), 0.6, 0.8)
    result = engine.prefill(BatchSpec(BatchId(1), (_req(1, list(range(5, 105)), 3),)))
    assert clock.take() == pytest.approx(cost.step([Fed(100, 0)]).total, rel=1e-9)
    assert result.batch is not None
    engine.decode([DecodeInput(BatchId(1))])
    assert clock.take() == pytest.approx(cost.step([Fed(1, 100)]).total, rel=1e-9)
    engine.clear()


def test_tokens_repeat_across_batches_and_engines_and_are_ordinary(sim: tuple[Engine, TallyClock]) -> None:
    engine, _ = sim
    a, b = _req(1, [7, 8, 9, 10], 12), _req(2, list(range(100, 160)), 12)
    alone = _run(engine, 1, [a])
    together = _run(engine, 2, [_req(3, [5, 5]), a, b])
    other, _ = _build(gpu="h100-80g")
    assert together[1] == alone[1] == _run(other, 1, [a])[1]
    assert len(alone[1]) == 12 and together[2] != together[1]
    card = engine.runner.config
    banned = {*card.eos_token_ids, card.bos_token_id}
    assert not banned & {t for ids in together.values() for t in ids}
    assert all(0 <= t < card.vocab_size for ids in together.values() for t in ids)
    seeded = SamplingParams(do_sample=True, seed=7)
    assert _run(engine, 4, [_req(1, [7, 8, 9, 10], 12, sampling=seeded)])[1] != alone[1]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def _refusals(engine: Engine) -> list[tuple[Callable[[], object], type[Exception]]]:
    ok = _req(900, [1, 2, 3])
    return [
        (lambda: engine.prefill(BatchSpec(BatchId(9), ())), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, []),))), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, [1, 10**6]),))), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (ok, _req(900, [4])))), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(100, [1]),))), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(100), (ok,))), AlreadyExists),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, [1] * 1100),))), ResourceExhausted),
        (lambda: engine.prefill(BatchSpec(BatchId(9), tuple(_req(i, [1 + i] * 300, 40) for i in range(4)))),
         ResourceExhausted),  # 4 x 22 pages > the 62 free (distinct prompts: identical ones share a prefix)
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, [1], sampling=SamplingParams(
            temperature=math.nan)),))), InvalidArgument),
        (lambda: engine.decode([DecodeInput(BatchId(12345))]), NotFound),
        (lambda: engine.decode([]), InvalidArgument),
        (lambda: engine.decode([DecodeInput(BatchId(100), (10**6,))]), InvalidArgument),
        (lambda: engine.filter(BatchId(12345), []), NotFound),
        (lambda: engine.filter(BatchId(100), [RequestId(77)]), InvalidArgument),
        (lambda: engine.clear(BatchId(12345)), NotFound),
    ]


def test_every_refusal_leaves_page_accounting_unchanged(sim: tuple[Engine, TallyClock]) -> None:
    engine, _ = sim
    running = engine.prefill(BatchSpec(BatchId(100), (_req(100, [1, 2, 3], 20),)))
    assert running.batch is not None
    free = engine.blocks.num_free
    assert free == engine.blocks.num_blocks - 2  # prompt and max_new_tokens: 23 tokens, 2 pages
    for call, error in _refusals(engine):
        with pytest.raises(error):
            call()
        assert engine.blocks.num_free == free, call
        assert [b.id for b in engine.store] == [100]
    assert engine.decode([DecodeInput(BatchId(100))]).batch is not None  # still serving


def test_pages_batching_merging_and_filtering(sim: tuple[Engine, TallyClock]) -> None:
    engine, _ = sim
    first = engine.prefill(BatchSpec(BatchId(1), (_req(1, [3] * 40, 30), _req(2, [4] * 10, 30))))
    second = engine.prefill(BatchSpec(BatchId(2), (_req(3, [5] * 17, 30),)))
    assert first.batch is not None and second.batch is not None
    assert engine.blocks.num_free == 64 - (5 + 3 + 3)  # prompt + max new: 70, 40, 47 tokens
    merged = engine.decode([DecodeInput(BatchId(1)), DecodeInput(BatchId(2))])
    assert merged.batch is not None and sorted(merged.batch.request_ids) == [1, 2, 3]
    assert len(merged.generations) == 3
    kept = engine.filter(merged.batch.id, [RequestId(3)])
    assert kept.request_ids == (3,)
    assert engine.blocks.num_free == 64 - 3
    engine.clear()
    assert engine.blocks.num_free == 64


def test_buffers_are_the_cards_sizes_times_the_scale(sim: tuple[Engine, TallyClock]) -> None:
    engine, _ = sim
    runner = engine.runner
    assert isinstance(runner, SimRunner)
    full_page = 2 * BLOCK * 4096 * 2  # one layer's K and V of 16 tokens, bf16
    assert runner.cache.full_page_bytes == full_page
    assert runner.cache.bytes_per_page() == full_page // 1024
    assert len(runner.cache.tensor) == 32 * 64 * (full_page // 1024)
    assert len(runner.sendable(runner.embed([]))) == 0
    assert runner.activation_bytes_per_token == 4096 * 2 // 1024


def test_kv_pages_default_to_what_the_gpu_leaves() -> None:
    small, _ = _build(num_blocks=None, gpu="a100-40g")
    large, _ = _build(num_blocks=None, gpu="a100-80g")
    assert 0 < small.blocks.num_blocks < large.blocks.num_blocks
    with pytest.raises(ValueError, match="no KV room"):
        _build(num_blocks=None, gpu="l4", model_card="llama-2-13b")
