"""The engine on one tiny Llama: seeded sampling, appended tokens, every refusal leaving pages untouched."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from replica.config import ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.runner import SeqInput
from replica.engine.types import (
    BatchId,
    BatchSpec,
    DecodeInput,
    FinishReason,
    RequestId,
    RequestSpec,
    SamplingParams,
    StoppingParams,
    WarmupSpec,
)
from replica.engine.warmup import warmup
from replica.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

SAMPLED = SamplingParams(
    do_sample=True, seed=1234, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1
)


@pytest.fixture(scope="module")
def engine(tiny_model_factory: Callable[..., Path]) -> Engine:
    return build_engine(
        ReplicaConfig(model=tiny_model_factory(arch="llama"), port=0, num_blocks=64, block_size=8)
    )


def _req(rid: int, prompt: list[int], max_new: int = 6, **kwargs: object) -> RequestSpec:
    stopping = kwargs.pop("stopping", StoppingParams(max_new_tokens=max_new))
    return RequestSpec(RequestId(rid), tuple(prompt), stopping=stopping, **kwargs)  # type: ignore[arg-type]


def _generate(engine: Engine, batch_id: int, requests: list[RequestSpec]) -> dict[int, list[int]]:
    """Run a batch to completion (no filtering: finished requests are skipped by decode)."""
    out: dict[int, list[int]] = {}
    result = engine.prefill(BatchSpec(BatchId(batch_id), tuple(requests)))
    while True:
        for g in result.generations:
            out.setdefault(g.request_id, []).extend(g.tokens.ids)
        if result.batch is None:
            return out
        result = engine.decode([DecodeInput(result.batch.id)])


def test_seeded_sampling_reproducible_across_batch_compositions(engine: Engine) -> None:
    prompt = [5, 17, 33, 99, 4]
    alone = _generate(engine, 1, [_req(7, prompt, 10, sampling=SAMPLED)])[7]
    others = [
        _req(i, [i + 3] * (i + 1), 3 + i, sampling=SamplingParams(do_sample=True, seed=i)) for i in range(5)
    ]
    crowded = _generate(engine, 2, [*others[:2], _req(70, prompt, 10, sampling=SAMPLED), *others[2:]])[70]
    assert alone == crowded and len(alone) == 10
    other_seed = SamplingParams(do_sample=True, seed=99, temperature=0.9, top_k=40, top_p=0.95)
    assert _generate(engine, 3, [_req(8, prompt, 10, sampling=other_seed)])[8] != alone
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_appended_tokens_continue_as_if_generated_here(engine: Engine, tiny_llama: Path) -> None:
    """A batch whose prompt K/V arrived from elsewhere (no first token) gets it through last_iter_tokens."""
    prompts = [[3, 50, 60, 70], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    refs = [
        hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]
    batch = engine.admit(BatchSpec(BatchId(40), tuple(_req(400 + i, p, 5) for i, p in enumerate(prompts))))
    engine.runner.forward([SeqInput(r.tokens, r.pages, 0) for r in batch])  # the "migrated" prompt K/V
    assert engine.adopt(batch).request_ids == (400, 401)
    tokens = {r.id: [r0[0]] for r, r0 in zip(batch, refs, strict=True)}
    first = tuple(t[0] for t in tokens.values())
    result = engine.decode([DecodeInput(BatchId(40), first)])
    while True:
        for g in result.generations:
            tokens[g.request_id].extend(g.tokens.ids)
        if result.batch is None:
            break
        result = engine.decode([DecodeInput(result.batch.id)])
    assert list(tokens.values()) == refs
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_text_outputs_stop_sequences_and_logprobs(engine: Engine, tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    spec = RequestSpec(
        RequestId(1),
        inputs="the quick brown fox",
        prefill_logprobs=True,
        top_n_tokens=3,
        stopping=StoppingParams(max_new_tokens=8, ignore_eos=True),
    )
    result = engine.prefill(BatchSpec(BatchId(50), (spec,)))
    (gen,) = result.generations
    assert (
        gen.prefill_tokens is not None
        and list(gen.prefill_tokens.ids) == tok("the quick brown fox").input_ids
    )
    assert math.isnan(gen.prefill_tokens.logprobs[0]) and all(
        lp <= 0 for lp in gen.prefill_tokens.logprobs[1:]
    )
    assert gen.top_tokens[0].ids[0] == gen.tokens.ids[0] and len(gen.top_tokens[0].ids) == 3
    texts, ids = list(gen.tokens.texts), list(gen.tokens.ids)
    batch = result.batch
    assert batch is not None
    while batch is not None:
        result = engine.decode([DecodeInput(batch.id)])
        batch = result.batch
        texts += [t for g in result.generations for t in g.tokens.texts]
        ids += [t for g in result.generations for t in g.tokens.ids]
    done = result.generations[0].generated_text
    assert done is not None and done.finish_reason is FinishReason.LENGTH and done.generated_tokens == 8
    assert done.text == tok.decode(ids, skip_special_tokens=True) and "".join(texts).startswith(done.text[:1])
    # the same request with a stop sequence taken from its own output stops there
    stop = "".join(texts)[1:3]
    if stop.strip():
        stopped = RequestSpec(
            RequestId(2),
            inputs="the quick brown fox",
            stopping=StoppingParams(max_new_tokens=8, stop_sequences=(stop,), ignore_eos=True),
        )
        out = _generate(engine, 51, [stopped])
        assert len(out[2]) < 8
    assert engine.blocks.num_free == engine.blocks.num_blocks


def _run(engine: Engine, batch_id: int, spec: RequestSpec) -> tuple[list[int], list[str], FinishReason]:
    """One request to its end: its tokens, their texts and why it stopped."""
    ids: list[int] = []
    texts: list[str] = []
    result = engine.prefill(BatchSpec(BatchId(batch_id), (spec,)))
    while True:
        (gen,) = result.generations
        ids += gen.tokens.ids
        texts += gen.tokens.texts
        if result.batch is None:
            assert gen.generated_text is not None
            return ids, texts, gen.generated_text.finish_reason
        result = engine.decode([DecodeInput(result.batch.id)])


def test_a_continuation_samples_and_stops_as_the_uninterrupted_run(engine: Engine) -> None:
    """A re-run after k tokens (prompt + those tokens, `generated_prefix=k`) draws with the same
    seeds and penalties an uninterrupted run would, and sees a stop sequence that spans the boundary."""
    prompt = [5, 17, 33, 2, 48, 9, 60]
    sampled = SamplingParams(
        do_sample=True, seed=77, temperature=0.9, top_k=50, repetition_penalty=1.2,
        frequency_penalty=0.8, presence_penalty=0.5,
    )
    stopping = StoppingParams(max_new_tokens=12, ignore_eos=True)
    whole, _, _ = _run(engine, 60, _req(1, prompt, sampling=sampled, stopping=stopping))
    for k in (1, 5, 11):
        rest = StoppingParams(max_new_tokens=12 - k, ignore_eos=True)
        cont = _req(1, prompt + whole[:k], sampling=sampled, stopping=rest, generated_prefix=k)
        assert _run(engine, 61, cont)[0] == whole[k:], k
    # without the field the earlier tokens are prompt: seeds restart and the penalties forget them
    plain = _req(1, prompt + whole[:5], sampling=sampled, stopping=StoppingParams(7, ignore_eos=True))
    assert _run(engine, 62, plain)[0] != whole[5:]

    greedy = StoppingParams(max_new_tokens=10, ignore_eos=True)
    ids, texts, _ = _run(engine, 63, _req(2, prompt, stopping=greedy))
    # a stop sequence made of the end of token k-1's text and the start of token k's, seen nowhere before
    spans = [(k, texts[k - 1][-1] + texts[k][0]) for k in range(1, 10) if texts[k - 1] and texts[k]]
    k, stop = next((k, stop) for k, stop in spans if stop not in "".join(texts[:k]))
    stopping = StoppingParams(max_new_tokens=10, stop_sequences=(stop,), ignore_eos=True)
    alone, _, why = _run(engine, 64, _req(2, prompt, stopping=stopping))
    assert alone == ids[: k + 1] and why is FinishReason.STOP_SEQUENCE
    rest = StoppingParams(max_new_tokens=10 - k, stop_sequences=(stop,), ignore_eos=True)
    cont_ids, _, why = _run(engine, 65, _req(2, prompt + ids[:k], stopping=rest, generated_prefix=k))
    assert cont_ids == ids[k : k + 1] and why is FinishReason.STOP_SEQUENCE
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_logit_bias_bans_and_forces_tokens(engine: Engine) -> None:
    prompt = [5, 17, 33, 2, 48, 9, 60]
    stopping = StoppingParams(max_new_tokens=6, ignore_eos=True)
    plain, _, _ = _run(engine, 70, _req(3, prompt, stopping=stopping))
    banned = SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(set(plain))))
    avoided, _, _ = _run(engine, 71, _req(3, prompt, stopping=stopping, sampling=banned))
    assert not set(avoided) & set(plain)
    forced = SamplingParams(do_sample=True, seed=3, logit_bias=((123, 100.0),))
    assert _run(engine, 72, _req(3, prompt, stopping=stopping, sampling=forced))[0] == [123] * 6
    assert engine.blocks.num_free == engine.blocks.num_blocks


def _refusals(engine: Engine) -> list[tuple[Callable[[], object], type[Exception]]]:
    ok = _req(900, [1, 2, 3])
    bad_sampling = [
        SamplingParams(temperature=math.nan),
        SamplingParams(temperature=-0.5),
        SamplingParams(top_p=1.01),
        SamplingParams(top_p=-1.0),
        SamplingParams(watermark=True),
        SamplingParams(logit_bias=((10**6, 1.0),)),
        SamplingParams(logit_bias=((3, math.inf),)),
        SamplingParams(logit_bias=((3, math.nan),)),
    ]
    cases: list[tuple[Callable[[], object], type[Exception]]] = [
        (lambda: engine.prefill(BatchSpec(BatchId(9), ())), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, []),))), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, [1, 10**6]),))), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (ok, _req(900, [4])))), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(100, [1]),))), InvalidArgument),  # id cached
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, [1], 0),))), InvalidArgument),
        (lambda: engine.prefill(BatchSpec(BatchId(100), (ok,))), AlreadyExists),
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, [1] * 600),))), ResourceExhausted),
        (
            lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, [1, 2], generated_prefix=3),))),
            InvalidArgument,
        ),  # more tokens "generated before" than the prompt has
        (lambda: engine.prefill(BatchSpec(BatchId(9), (_req(1, [1] * 50, 500),))), ResourceExhausted),
        (
            lambda: engine.prefill(
                BatchSpec(BatchId(9), tuple(_req(i, [1 + i] * 100, 60) for i in range(4)))
            ),
            ResourceExhausted,
        ),  # 4 x 20 pages > the 61 free pages (distinct prompts: identical ones would share their prefix)
        (
            lambda: engine.prefill(
                BatchSpec(BatchId(9), (_req(1, [1], truncate=None, inputs=""), _req(2, [], inputs="")))
            ),
            InvalidArgument,
        ),
        (lambda: engine.decode([DecodeInput(BatchId(12345))]), NotFound),
        (lambda: engine.decode([]), InvalidArgument),
        (lambda: engine.decode([DecodeInput(BatchId(100), (1, 2, 3))]), InvalidArgument),
        (lambda: engine.decode([DecodeInput(BatchId(100), (10**6,))]), InvalidArgument),
        (lambda: engine.decode([DecodeInput(BatchId(100)), DecodeInput(BatchId(100))]), InvalidArgument),
        (lambda: engine.filter(BatchId(12345), []), NotFound),
        (lambda: engine.filter(BatchId(100), [RequestId(77)]), InvalidArgument),
        (lambda: engine.clear(BatchId(12345)), NotFound),
        (lambda: warmup(engine, WarmupSpec(max_input_tokens=10**6), None), ResourceExhausted),
    ]
    for params in bad_sampling:
        spec = BatchSpec(BatchId(9), (_req(1, [1], sampling=params),))
        cases.append((partial(engine.prefill, spec), InvalidArgument))
    return cases


def test_every_refusal_leaves_page_accounting_unchanged(engine: Engine) -> None:
    running = engine.prefill(BatchSpec(BatchId(100), (_req(100, [1, 2, 3], 20),)))
    assert running.batch is not None
    free = engine.blocks.num_free
    for call, error in _refusals(engine):
        with pytest.raises(error):
            call()
        assert engine.blocks.num_free == free, call
        assert [b.id for b in engine.store] == [100]
    follow = engine.decode([DecodeInput(BatchId(100))])  # still serving
    assert follow.generations and follow.batch is not None
    engine.clear()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_warmup_runs_the_profile_and_reports_capacity(engine: Engine) -> None:
    assert warmup(engine, WarmupSpec(max_prefill_tokens=100), None) == engine.blocks.num_blocks * 8
    assert engine.blocks.num_free == engine.blocks.num_blocks
    given = WarmupSpec(batch=BatchSpec(BatchId(70), (_req(700, [1] * 30, 4),)))
    assert warmup(engine, given, None) == engine.blocks.num_blocks * 8
    assert engine.blocks.num_free == engine.blocks.num_blocks and len(engine.store) == 0


def test_filter_to_nothing_drops_the_batch(engine: Engine) -> None:
    result = engine.prefill(BatchSpec(BatchId(60), (_req(600, [1, 2]), _req(601, [3]))))
    assert result.batch is not None
    kept = engine.filter(BatchId(60), [RequestId(601)])
    assert kept.request_ids == (601,)
    assert engine.filter(BatchId(60), []).size == 0
    assert BatchId(60) not in engine.store and engine.blocks.num_free == engine.blocks.num_blocks
