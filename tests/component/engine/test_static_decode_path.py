"""The decode path CUDA graphs replay, run eagerly on the CPU: static buffers padded to a bucket give
the same logits and tokens as the ordinary forward (Triton's interpreter runs the paged kernel)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from replica.config import ReplicaConfig
from replica.engine.backend import SeqInput
from replica.engine.cuda_graphs import batch_buckets
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.runner import ModelRunner
from tests.helpers.engine_driver import Driver


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    pytest.importorskip("triton", reason="the paged kernel needs triton (the dev extra)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _engine(path: Path) -> Engine:
    config = ReplicaConfig(model=path, port=0, num_blocks=96, block_size=4, device="cpu",
                           attention_backend="triton")
    return build_engine(config)


def test_buckets() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(10) == (1, 2, 4, 8, 10)
    assert batch_buckets(256)[-3:] == (160, 192, 256)
    with pytest.raises(ValueError):
        batch_buckets(0)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_static_decode_logits_equal_the_ordinary_forward(
    interpreted: None, tiny_model_factory: Callable[..., Path], rows: int
) -> None:
    engine = _engine(tiny_model_factory(arch="llama", kv_heads=2))
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    gen = torch.Generator().manual_seed(rows)
    seqs = []
    for i in range(rows):
        length = 3 + 5 * i
        pages = engine.blocks.allocate(engine.blocks.pages_for(length + 1))
        prompt = torch.randint(3, engine.limits.vocab_size, (length,), generator=gen).tolist()
        runner.forward([SeqInput(prompt, pages, 0)])
        seqs.append(SeqInput([prompt[-1]], pages, length))
    before = runner.cache.tensor.clone()
    eager = runner.forward(seqs).last_logits.clone()
    after_eager = runner.cache.tensor.clone()
    runner.cache.tensor.copy_(before)
    static = runner.static_decoder(max_batch=8)
    assert static.accepts(seqs) and static.bucket(rows) >= rows
    got = static.run(seqs)
    assert got.shape == eager.shape
    torch.testing.assert_close(got, eager, atol=2e-5, rtol=1e-5)
    # the padded rows wrote exactly what row 0 wrote: the pages equal the eager step's
    torch.testing.assert_close(runner.cache.tensor, after_eager, atol=1e-6, rtol=0)


def test_engine_tokens_with_the_static_path_equal_eager(
    interpreted: None, tiny_model_factory: Callable[..., Path]
) -> None:
    path = tiny_model_factory(arch="llama", kv_heads=2)
    gen = torch.Generator().manual_seed(3)
    work = [(torch.randint(3, 200, (2 + (i * 5) % 13,), generator=gen).tolist(), 2 + i % 5) for i in range(7)]
    results = []
    for static in (False, True):
        engine = _engine(path)
        if static:
            assert isinstance(engine.runner, ModelRunner)
            engine.runner.graphs = engine.runner.static_decoder(max_batch=4)  # 7 rows: some steps eager
        driver = Driver(engine)
        driver.prefill(1, 0, work[:4])
        driver.decode(1)
        driver.prefill(2, 4, work[4:])
        driver.decode(8)
        assert driver.running is None and engine.blocks.num_free == engine.blocks.num_blocks
        results.append(driver.tokens)
    assert results[0] == results[1]
