"""The sampler fuzz of tests/unit/engine/test_sampling_fuzz.py with real xgrammar masks (the tiny
model's vocabulary: a JSON Schema's and a regex's first step) mixed with free rows in one batch."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.engine.device_sampling import choose_batched
from replica.engine.grammar import Grammars, GrammarState
from replica.engine.sampling import choose_next
from replica.engine.types import GrammarKind, GrammarSpec
from tests.unit.engine.test_sampling_fuzz import F32_MAX, rows


@pytest.fixture(scope="module")
def grammar_states(tiny_model_factory: Callable[..., Path]) -> tuple[int, list[GrammarState]]:
    """(vocabulary size, grammar states at the start of a JSON Schema and of a regex) of the tiny model."""
    import json

    from tokenizers import Tokenizer

    folder = tiny_model_factory()
    config = json.loads((folder / "config.json").read_text())
    vocab = int(config["vocab_size"])
    eos = config["eos_token_id"]
    grammars = Grammars(
        Tokenizer.from_file(str(folder / "tokenizer.json")), vocab, eos if isinstance(eos, list) else [eos]
    )
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    specs = [
        GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)),
        GrammarSpec(GrammarKind.REGEX, "[ab]+c"),
    ]
    return vocab, [grammars.state(spec, []) for spec in specs]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_grammar_rows_mixed_with_free_rows_never_break(
    grammar_states: tuple[int, list[GrammarState]], data: st.DataObject
) -> None:
    """Real xgrammar masks (a JSON Schema's and a regex's first step) in one batch with free rows,
    under every parameter: the chosen token is one the grammar allows, and nothing is NaN."""
    vocab, states = grammar_states
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    scale = data.draw(st.sampled_from([1.0, 1e4, 1e30, 3e38]))
    count = data.draw(st.integers(1, 4))
    logits = (
        (torch.rand(count, vocab, generator=generator) * 2 - 1).mul(scale).clamp(-F32_MAX, F32_MAX).to(dtype)
    )
    inputs = []
    for _ in range(count):
        _, inp = data.draw(rows(vocab))  # its parameters and tokens; the logits are the tensor's
        grammar = data.draw(st.sampled_from([None, *states]))
        inputs.append(inp._replace(grammar=grammar))
    for choices in (choose_next(logits, inputs), choose_batched(logits, inputs)):
        for choice, inp in zip(choices, inputs, strict=True):
            assert not math.isnan(choice.logprob)
            assert inp.grammar is None or inp.grammar.allows(choice.token_id)
