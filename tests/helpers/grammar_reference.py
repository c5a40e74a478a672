"""transformers' greedy generation with a grammar's token mask applied at every step, through
xgrammar itself: the reference that constrained greedy output of the engine must equal."""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from replica.engine.grammar import compile_with
from replica.engine.types import GrammarSpec


def grammar_compiler(model_dir: Path, vocab_size: int, stop: Iterable[int]) -> xgr.GrammarCompiler:
    """A compiler for the checkpoint's tokenizer, built the transformers way."""
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab_size, stop_token_ids=sorted(stop)
    )
    return xgr.GrammarCompiler(info)


def constrained_greedy(
    hf: Any,
    compiler: xgr.GrammarCompiler,
    spec: GrammarSpec,
    prompt: Sequence[int],
    stop: Set[int],
    max_new: int,
) -> list[int]:
    """transformers' greedy tokens with the grammar's mask applied to every step's logits (a full
    forward per step: slow and obviously right)."""
    matcher = xgr.GrammarMatcher(compile_with(compiler, spec), override_stop_tokens=sorted(stop))
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens], device=hf.device)).logits[0, -1:].float().clone()
        mask = xgr.allocate_token_bitmask(1, logits.shape[-1])
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device))
        token = int(logits.argmax(-1))
        assert matcher.accept_token(token)
        out.append(token)
        tokens.append(token)
        if token in stop:
            break
    return out


# JSON Schemas the structured-output tests use: nested objects, enums, arrays (small: a tiny random
# model under the mask finishes them in a few tokens)
SCHEMAS: dict[str, dict[str, Any]] = {
    "enum": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "tag": {"enum": ["a", "b"]},
                },
                "required": ["x", "tag"],
            },
        },
        "required": ["ok", "point"],
    },
    "array": {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["items"],
    },
}
