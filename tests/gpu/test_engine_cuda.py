"""The engine on a CUDA device against transformers on the same device, token for token.

The same router-like schedule as the CPU test (three prefill batches merged into the running batch,
finished requests filtered), with the weights, the paged KV cache and every step on the GPU; float32
with TF32 off, so both sides compute the same numbers. Skips without a CUDA device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from replica.config import ReplicaConfig
from replica.engine.factory import build_engine
from tests.helpers.engine_driver import Driver

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "intermediate": 512},
    "mistral": {"arch": "mistral", "kv_heads": 1, "sliding_window": 24},
    "qwen2": {"arch": "qwen2", "tie_embeddings": True},
}


def _greedy(hf: Any, prompt: Sequence[int], max_new: int) -> list[int]:
    inp = torch.tensor([list(prompt)], device="cuda")
    out = hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, do_sample=False,
                      pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_engine_on_cuda_matches_transformers_on_cuda(
    tiny_model_factory: Callable[..., Path], arch: str,
) -> None:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = tiny_model_factory(**ARCHS[arch])
    engine = build_engine(ReplicaConfig(model=path, port=0, num_blocks=200, block_size=8), device="cuda")
    assert engine.meta.device_type == "cuda"
    total_free = engine.blocks.num_free
    gen = torch.Generator().manual_seed(5)
    work = [(torch.randint(3, engine.limits.vocab_size, (1 + (i * 7) % 40,), generator=gen).tolist(),
             1 + (i * 5) % 12) for i in range(24)]
    driver = Driver(engine)
    driver.prefill(1, 0, work[:10])
    driver.decode(2)
    driver.prefill(2, 10, work[10:18])
    driver.decode(1)
    driver.prefill(3, 18, work[18:])
    driver.decode(20)
    assert driver.running is None and engine.blocks.num_free == total_free

    hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    with torch.no_grad():
        for rid, (prompt, max_new) in enumerate(work):
            assert driver.tokens[rid] == _greedy(hf, prompt, max_new), f"{arch} request {rid}"
