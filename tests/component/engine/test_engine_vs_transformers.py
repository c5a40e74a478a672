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
from replica.engine.factory import build_engine
from replica.model.compiled_attention import compiler_missing
from tests.helpers.engine_driver import Driver, reference_greedy, run_mixed_schedule

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


NO_CXX = pytest.mark.skipif(compiler_missing() is not None, reason="no g++")
# `auto` is the native C++ decode kernel on the CPU where a compiler is (built in under a second,
# then cached), else torch; torch (gather + SDPA) is the reference path; the compiled CPU decode
# attention compiles for seconds: the slow tier
COMPILED = [pytest.param(arch, "compiled", marks=[pytest.mark.long, NO_CXX]) for arch in sorted(ARCHS)]
AUTO = "torch" if compiler_missing() is not None else "native"


@pytest.mark.parametrize(
    ("arch", "backend"),
    [pytest.param(arch, b) for b in ("auto", "torch") for arch in sorted(ARCHS)] + COMPILED,
)
def test_engine_matches_transformers_greedy(
    tiny_model_factory: Callable[..., Path], arch: str, backend: str
) -> None:
    path = tiny_model_factory(**ARCHS[arch])
    config = ReplicaConfig(model=path, port=0, num_blocks=200, block_size=8, attention_backend=backend)
    engine = build_engine(config)
    assert engine.meta.attention_backend == (AUTO if backend == "auto" else backend)
    total_free = engine.blocks.num_free
    work = _workload(engine.limits.vocab_size)
    driver = Driver(engine)
    run_mixed_schedule(driver, work)
    assert driver.running is None and len(engine.store) == 0
    assert engine.blocks.num_free == total_free

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for rid, (prompt, max_new) in enumerate(work):
        tokens, logprobs = reference_greedy(hf, prompt, max_new)
        assert driver.tokens[rid] == tokens, f"{arch} request {rid} (prompt {len(prompt)} tokens)"
        assert driver.logprobs[rid] == pytest.approx(logprobs, abs=LOGPROB_ATOL)
