"""Structured output in the engine: JSON Schema, JSON object and regex grammars masking the sampler.

Greedy constrained generation is checked token for token against transformers with the same mask
applied (a reference loop through xgrammar itself), in batches that mix constrained and free
requests; outputs validate against their schema (`jsonschema`); a continuation rebuilds the matcher
from its generated prefix; bad grammars and refused appended tokens change nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM

from replica.config import ReplicaConfig
from replica.engine.device_sampling import choose_batched
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.sampling import choose_next
from replica.engine.types import (
    BatchId,
    BatchSpec,
    DecodeInput,
    FinishReason,
    GrammarKind,
    GrammarSpec,
    RequestId,
    RequestSpec,
    RowInput,
    SamplingParams,
    StoppingParams,
)
from replica.errors import InvalidArgument
from tests.helpers.grammar_reference import SCHEMAS, constrained_greedy, grammar_compiler

MAX_NEW = 48


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return build_engine(ReplicaConfig(model=model_dir, port=0, num_blocks=128, block_size=8))


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def compiler(model_dir: Path, engine: Engine) -> xgr.GrammarCompiler:
    return grammar_compiler(model_dir, engine.limits.vocab_size, engine.eos_token_ids)


def _spec(name: str) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMAS[name]))


def _run(engine: Engine, batch_id: int, requests: list[RequestSpec]) -> dict[int, tuple[list[int], Any]]:
    """Run a batch to completion: tokens and final GeneratedText per request."""
    out: dict[int, tuple[list[int], Any]] = {r.id: ([], None) for r in requests}
    result = engine.prefill(BatchSpec(BatchId(batch_id), tuple(requests)))
    while True:
        for g in result.generations:
            out[g.request_id][0].extend(g.tokens.ids)
            if g.generated_text is not None:
                out[g.request_id] = (out[g.request_id][0], g.generated_text)
        if result.batch is None:
            return out
        result = engine.decode([DecodeInput(result.batch.id)])


def _req(rid: int, prompt: list[int], grammar: GrammarSpec | None, **kw: Any) -> RequestSpec:
    return RequestSpec(
        RequestId(rid), tuple(prompt), stopping=StoppingParams(max_new_tokens=MAX_NEW), grammar=grammar, **kw
    )


def test_greedy_constrained_equals_transformers_with_the_same_mask(
    engine: Engine, hf: Any, compiler: xgr.GrammarCompiler
) -> None:
    prompts = [[1, 5, 9, 13], [1, 40, 41], [1, 77, 3, 88, 90], [1, 100]]
    specs = [_spec("enum"), None, _spec("nested"), _spec("array")]
    free = engine.blocks.num_free
    outs = _run(engine, 1, [_req(i, p, s) for i, (p, s) in enumerate(zip(prompts, specs, strict=True))])
    assert engine.blocks.num_free == free
    stop = set(engine.eos_token_ids)
    for i, (prompt, spec) in enumerate(zip(prompts, specs, strict=True)):
        tokens, final = outs[i]
        if spec is None:  # the free row in the same batch is unaffected by its neighbours' masks
            reference = hf.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0
            )
            expected = reference[0, len(prompt) :].tolist()
            assert tokens == expected[: len(tokens)]
            continue
        assert tokens == constrained_greedy(hf, compiler, spec, prompt, stop, MAX_NEW)
        assert final.finish_reason is FinishReason.EOS_TOKEN, final
        jsonschema.validate(json.loads(final.text), json.loads(spec.text))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_outputs_validate(engine: Engine, name: str) -> None:
    sampling = SamplingParams(
        do_sample=True, seed=7, temperature=1.3, repetition_penalty=1.2, frequency_penalty=0.5
    )
    requests = [_req(i, [1, 20 + i, 30], _spec(name), sampling=sampling) for i in range(3)]
    for _, final in _run(engine, 2, requests).values():
        assert final.finish_reason is FinishReason.EOS_TOKEN, final
        jsonschema.validate(json.loads(final.text), SCHEMAS[name])


def test_json_object_and_regex(engine: Engine) -> None:
    requests = [
        _req(0, [1, 8, 9], GrammarSpec(GrammarKind.REGEX, r"(yes|no)-[0-9]{2}")),
        _req(
            1,
            [1, 8, 10],
            GrammarSpec(GrammarKind.JSON_OBJECT),
            sampling=SamplingParams(do_sample=True, seed=3),
        ),
    ]
    outs = _run(engine, 3, requests)
    assert re.fullmatch(r"(yes|no)-[0-9]{2}", outs[0][1].text)
    text, reason = outs[1][1].text, outs[1][1].finish_reason
    # any object: the tiny model may not close it within MAX_NEW, but what it wrote is an object's start
    assert text.startswith("{")
    if reason is FinishReason.EOS_TOKEN:
        assert isinstance(json.loads(text), dict)


def test_continuation_rebuilds_the_grammar_from_its_generated_prefix(engine: Engine) -> None:
    prompt, spec = [1, 77, 3, 88, 90], _spec("nested")
    whole = _run(engine, 4, [_req(0, prompt, spec)])[0][0]
    k = len(whole) // 2
    resumed = RequestSpec(
        RequestId(0),
        tuple(prompt + whole[:k]),
        stopping=StoppingParams(max_new_tokens=MAX_NEW - k),
        generated_prefix=k,
        grammar=spec,
    )
    assert _run(engine, 5, [resumed])[0][0] == whole[k:]


def test_bad_grammars_and_refused_tokens_change_nothing(engine: Engine) -> None:
    free = engine.blocks.num_free
    bad = [
        GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "bogus"}'),
        GrammarSpec(GrammarKind.JSON_SCHEMA, "not json"),
        GrammarSpec(GrammarKind.REGEX, "(unclosed"),
    ]
    for spec in bad:
        with pytest.raises(InvalidArgument, match="grammar"):
            engine.prefill(BatchSpec(BatchId(6), (_req(0, [1, 2, 3], None), _req(1, [1, 2, 3], spec))))
        assert engine.blocks.num_free == free
    # a continuation whose generated prefix the grammar refuses ("{" must come first)
    with pytest.raises(InvalidArgument, match="does not match the grammar"):
        engine.admit(
            BatchSpec(
                BatchId(6), (RequestSpec(RequestId(0), (1, 2, 3), generated_prefix=1, grammar=_spec("enum")),)
            )
        )
    assert engine.blocks.num_free == free
    # appended tokens (DecodeV2 last_iter_tokens) are checked against the grammar before anything changes
    result = engine.prefill(BatchSpec(BatchId(7), (_req(0, [1, 2, 3], _spec("enum")),)))
    assert result.batch is not None
    with pytest.raises(InvalidArgument, match="grammar"):
        engine.decode([DecodeInput(result.batch.id, (3,))])
    batch = engine.store.get(result.batch.id)
    assert len(batch.requests[0].tokens) == 4
    engine.clear(result.batch.id)
    assert engine.blocks.num_free == free


def test_batched_path_masks_the_same_rows(engine: Engine) -> None:
    """choose_batched (the device path, run on the CPU here) masks exactly like choose_next."""
    states = [engine.grammars.state(_spec(n), []) for n in ("enum", "nested")]
    logits = torch.randn(4, engine.limits.vocab_size, generator=torch.Generator().manual_seed(0))
    sampled = SamplingParams(do_sample=True, seed=11, top_k=5)
    rows = [
        RowInput(SamplingParams(), [1, 2], 2, 0, states[0]),
        RowInput(SamplingParams(), [1, 2], 2),
        RowInput(sampled, [1, 2], 2, 3, states[1]),
        RowInput(SamplingParams(repetition_penalty=1.5), [1, 2], 2),
    ]
    cpu, batched = choose_next(logits, rows), choose_batched(logits, rows)
    assert [c.token_id for c in cpu][:2] == [c.token_id for c in batched][:2]
    for choice, state in ((cpu[0], states[0]), (batched[0], states[0]), (batched[2], states[1])):
        assert state.allows(choice.token_id)
    # refused tokens have probability 0: every alternative with a finite log-probability is allowed
    finite = [t for t, lp in zip(cpu[2].top_ids, cpu[2].top_logprobs, strict=True) if lp > float("-inf")]
    assert finite and all(states[1].allows(t) for t in finite)
    assert len(finite) < 3  # the nested schema's first token can only be "{"


def test_the_simulated_engine_keeps_to_the_grammar_and_needs_a_tokenizer(model_dir: Path) -> None:
    from replica.config import EngineKind
    from replica.engine.sim.clock import TallyClock
    from replica.engine.sim.factory import build_simulated
    from replica.errors import FailedPrecondition

    base: dict[str, Any] = {
        "port": 0,
        "engine": EngineKind.SIMULATED,
        "gpu": "a100-80g",
        "num_blocks": 64,
        "block_size": 8,
        "byte_scale": "1/1024",
    }
    sim, _ = build_simulated(ReplicaConfig(model=model_dir, **base), TallyClock())
    for name in sorted(SCHEMAS):
        outs = _run(sim, 8, [_req(0, [1, 5, 6], _spec(name))])
        assert outs[0][1].finish_reason is FinishReason.EOS_TOKEN
        jsonschema.validate(json.loads(outs[0][1].text), SCHEMAS[name])
    bare, _ = build_simulated(ReplicaConfig(model_card="llama-2-7b", **base), TallyClock())
    with pytest.raises(FailedPrecondition, match="tokenizer"):
        bare.prefill(BatchSpec(BatchId(9), (_req(0, [1, 5, 6], _spec("enum")),)))
    assert bare.blocks.num_free == bare.blocks.num_blocks
