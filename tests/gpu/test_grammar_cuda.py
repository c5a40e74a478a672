"""Structured output on a CUDA device: the grammar masks of the batched sampler on CUDA logits are the
CPU's, and the engine on CUDA (float32, TF32 off) gives transformers' constrained greedy tokens on
the same device, in a batch mixing constrained and free requests, with CUDA graphs on; in bfloat16
the constrained outputs validate against their schemas. Skips without a CUDA device."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from replica.config import DType
from replica.engine.grammar import masked
from replica.engine.types import (
    GrammarKind,
    GrammarSpec,
    RequestId,
    RequestSpec,
    RowInput,
    SamplingParams,
    StoppingParams,
)
from tests.helpers.cuda_engines import CUDA_REASON, cuda_engine, run_to_end, tf32_off
from tests.helpers.grammar_reference import constrained_greedy, grammar_compiler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "tags", "n"],
}
SPEC = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
MAX_NEW = 40


GREEDY = SamplingParams()


def _requests(prompts: list[list[int]], sampling: SamplingParams = GREEDY) -> list[RequestSpec]:
    """Every other request constrained."""
    return [
        RequestSpec(
            RequestId(i),
            tuple(p),
            sampling=sampling,
            stopping=StoppingParams(max_new_tokens=MAX_NEW),
            grammar=SPEC if i % 2 == 0 else None,
        )
        for i, p in enumerate(prompts)
    ]


def test_masks_on_cuda_logits_equal_the_cpus(tiny_model_factory: Callable[..., Path]) -> None:
    engine = cuda_engine(tiny_model_factory(arch="llama"))
    states = [engine.grammars.state(SPEC, []) for _ in range(3)]
    rows = [
        RowInput(SamplingParams(), [1], 1, 0, states[0]),
        RowInput(SamplingParams(), [1], 1),
        RowInput(SamplingParams(), [1], 1, 0, states[2]),
    ]
    logits = torch.randn(3, engine.limits.vocab_size, generator=torch.Generator().manual_seed(0))
    on_cpu = masked(logits, rows)
    on_cuda = masked(logits.to("cuda"), rows).cpu()
    assert torch.equal(on_cpu, on_cuda)
    assert torch.equal(on_cuda[1], logits[1]) and torch.isinf(on_cuda[0]).any()


def test_float32_constrained_greedy_equals_transformers_on_cuda(
    tiny_model_factory: Callable[..., Path],
) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(arch="llama")
    prompts = [[1, 5, 9, 13], [1, 40, 41], [1, 77, 3, 88, 90], [1, 100], [1, 7, 7, 7]]
    with tf32_off():
        engine = cuda_engine(path, DType.FLOAT32)
        out = run_to_end(engine, 1, _requests(prompts))
        hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf = hf.to("cuda").eval()
        stop = set(engine.eos_token_ids)
        compiler = grammar_compiler(path, engine.limits.vocab_size, stop)
        for i, prompt in enumerate(prompts):
            if i % 2 == 0:
                assert out[i] == constrained_greedy(hf, compiler, SPEC, prompt, stop, MAX_NEW)
                assert out[i][-1] in stop
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_bfloat16_constrained_outputs_validate(tiny_model_factory: Callable[..., Path]) -> None:
    engine = cuda_engine(tiny_model_factory(arch="llama"), DType.BFLOAT16)
    prompts = [[1, 20 + i, 30] for i in range(8)]
    sampled = SamplingParams(do_sample=True, seed=5, temperature=1.2, top_k=50, repetition_penalty=1.1)
    for batch_id, sampling in enumerate((GREEDY, sampled), start=2):
        out = run_to_end(engine, batch_id, _requests(prompts, sampling))
        for i in range(0, len(prompts), 2):
            text = engine.detok.decode(out[i], skip_special_tokens=True)
            jsonschema.validate(json.loads(text), SCHEMA)
    assert engine.blocks.num_free == engine.blocks.num_blocks
