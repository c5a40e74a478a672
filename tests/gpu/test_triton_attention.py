"""The Triton paged-attention backend against the torch gather path on CUDA: greedy tokens equal in
float32 (TF32 off) under a router-like schedule (prefills merged into a running batch, requests
finishing at different steps), on a GQA llama and a sliding-window mistral. Both engines decode
eagerly, so only the attention differs. Skips without a CUDA device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from replica.config import DType
from replica.engine.engine import Engine
from tests.helpers.cuda_engines import CUDA_REASON, cuda_engine, random_prompts, tf32_off
from tests.helpers.engine_driver import Driver

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)

DEVICE = "cuda"
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "intermediate": 512},
    "mistral": {"arch": "mistral", "kv_heads": 1, "sliding_window": 24},
}


def _drive(engine: Engine) -> dict[int, list[int]]:
    total = engine.blocks.num_free
    prompts = random_prompts(24, engine.limits.vocab_size, seed=3, longest=60)
    work = [(p, 1 + (i * 5) % 16) for i, p in enumerate(prompts)]
    driver = Driver(engine)
    driver.prefill(1, 0, work[:10])
    driver.decode(3)
    driver.prefill(2, 10, work[10:])
    driver.decode(20)
    assert driver.running is None and engine.blocks.num_free == total
    return driver.tokens


@pytest.mark.parametrize("name", sorted(MODELS))
def test_triton_backend_equals_torch_backend(tiny_model_factory: Callable[..., Path], name: str) -> None:
    path = tiny_model_factory(**MODELS[name])
    with tf32_off():
        engines = {backend: cuda_engine(path, DType.FLOAT32, num_blocks=400, device=DEVICE, cuda_graphs=False,
                                        attention_backend=backend) for backend in ("torch", "triton")}
        assert engines["torch"].meta.attention_backend == "torch"
        assert engines["triton"].meta.attention_backend == "triton"
        assert _drive(engines["triton"]) == _drive(engines["torch"])
