"""Structured output through REAL replica processes (`pdcluster up`'s LocalCluster, tiny model):
the OpenAI SDK's `response_format` and the TGI client's `grammar` give output that validates, the
same under every migration strategy, also when the decode replica is killed mid-generation (the
re-run rebuilds the grammar from the tokens generated so far); a bad schema is a 400 naming it.
One cluster for the module (1 prefill + 2 decode)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from text_generation import AsyncClient as TGIAsyncClient
from text_generation import Client as TGIClient
from text_generation.types import Grammar, GrammarType

from pdcluster.cluster.local import LocalCluster, UpConfig
from router import strategies
from router.config import Strategy
from tests.helpers.eventually import eventually
from tests.helpers.grammar_reference import SCHEMAS
from tests.helpers.router_cluster import grpcurl, wait_pages_free

TOKEN = "structured-test-token"
# long enough (a fixed 120-item array) that the streams still run when a decode replica is killed
LONG = {
    "type": "object",
    "properties": {"v": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 120, "maxItems": 120}},
    "required": ["v"],
}
MAX_NEW = 64


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = UpConfig(
        model=model_dir,
        prefill=1,
        decode=2,
        strategy=Strategy.FULL.value,
        http_port=0,
        admin_port=0,
        num_blocks=256,
        admin_token=TOKEN,
        log_dir=tmp_path_factory.mktemp("structured-logs"),
        ready_timeout=120,
    )
    with LocalCluster(config) as running:
        yield running


def _reference_texts(model_dir: Path) -> dict[str, str]:
    """transformers' greedy answer to `_chat`'s prompt for each schema, the same mask applied."""
    import torch
    from transformers import AutoModelForCausalLM

    from replica.engine.types import GrammarKind, GrammarSpec
    from router.tokenizer import Tokenizer
    from tests.helpers.grammar_reference import constrained_greedy, grammar_compiler

    tok = Tokenizer.from_model_dir(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    compiler = grammar_compiler(model_dir, hf.config.vocab_size, tok.eos_token_ids)
    texts = {}
    for name, schema in SCHEMAS.items():
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Give me a {name}"}], True)
        ids = tok.encode(prompt, add_special_tokens=False)
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
        tokens = constrained_greedy(hf, compiler, spec, ids, set(tok.eos_token_ids), MAX_NEW)
        texts[name] = tok.decode(tokens)
    return texts


def set_strategy(cluster: LocalCluster, strategy: str) -> None:
    grpcurl(cluster.admin_address, "SetMigrationStrategy", {"name": strategy}, TOKEN)


def _client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", timeout=60, max_retries=0)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat(client: openai.OpenAI, name: str, schema: dict[str, Any], **kw: Any) -> Any:
    return client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": f"Give me a {name}"}],
        max_tokens=MAX_NEW,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        **kw,
    )


def test_json_schema_outputs_validate_and_equal_transformers_under_every_strategy(
    cluster: LocalCluster, model_dir: Path
) -> None:
    client = _client(cluster)
    expected = _reference_texts(model_dir)
    seen: dict[str, dict[str, str]] = {}
    for strategy in strategies.names():
        set_strategy(cluster, strategy)
        for name, schema in SCHEMAS.items():
            choice = _chat(client, name, schema).choices[0]
            assert choice.finish_reason == "stop", (strategy, name, choice)
            jsonschema.validate(json.loads(choice.message.content), schema)
            seen.setdefault(name, {})[strategy] = choice.message.content
    for name, texts in seen.items():  # greedy: every strategy gives transformers' tokens
        assert set(texts.values()) == {expected[name]}, (name, texts, expected[name])
    assert all(
        i.num_blocks_free == i.num_blocks_total
        for i in wait_pages_free([p.address for p in cluster.replicas])
    )


def test_json_object_on_completions_and_streamed_chat(cluster: LocalCluster) -> None:
    set_strategy(cluster, Strategy.FULL.value)
    client = _client(cluster)
    # completions: response_format rides in extra_body (the SDK's completions type has no such field)
    done = client.completions.create(
        model=_model(client),
        prompt="The quick brown fox",
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = done.choices[0].text
    assert text.startswith("{")
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    stream = _chat(client, "nested", SCHEMAS["nested"], stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    jsonschema.validate(json.loads("".join(pieces)), SCHEMAS["nested"])
    assert "".join(pieces) == _chat(client, "nested", SCHEMAS["nested"]).choices[0].message.content


def test_tgi_grammar_json_and_regex(cluster: LocalCluster) -> None:
    set_strategy(cluster, Strategy.PROGRESSIVE.value)
    client = TGIClient(cluster.http_url, timeout=60)
    out = client.generate(
        "Tell me", max_new_tokens=MAX_NEW, grammar=Grammar(type=GrammarType.Json, value=SCHEMAS["array"])
    )
    jsonschema.validate(json.loads(out.generated_text), SCHEMAS["array"])
    out = client.generate(
        "Tell me",
        max_new_tokens=MAX_NEW,
        do_sample=True,
        seed=3,
        grammar=Grammar(type=GrammarType.Regex, value=r"(yes|no), [0-9]{3}"),
    )
    assert re.fullmatch(r"(yes|no), [0-9]{3}", out.generated_text)
    assert out.details.finish_reason.value == "eos_token"


def test_bad_grammars_are_400s_naming_the_field(cluster: LocalCluster) -> None:
    client = _client(cluster)
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, "bad", {"type": "bogus"})
    assert refused.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    assert "bogus" in refused.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=_model(client),
            messages=[{"role": "user", "content": "x"}],
            extra_body={"response_format": {"type": "json_schema"}},  # no schema: the SDK's types forbid it
        )
    assert refused.value.body["param"].startswith("response_format")  # type: ignore[index]
    answer = httpx.post(
        f"{cluster.http_url}/generate",
        timeout=30,
        json={"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}},
    )
    assert answer.status_code == 400 and "grammar" in answer.json()["error"]


@pytest.mark.parametrize(
    "strategy", [Strategy.FULL.value, Strategy.PROGRESSIVE.value, Strategy.RECOMPUTE.value]
)
def test_decode_replica_killed_mid_generation_output_still_validates(
    cluster: LocalCluster, strategy: str
) -> None:
    """Each run kills a busy decode replica, checks the outputs, then restarts it for the next."""
    set_strategy(cluster, strategy)
    grammar = Grammar(type=GrammarType.Json, value=LONG)
    prompts = [f"list number {i}:" for i in range(4)]
    max_new = 400
    reference = [
        TGIClient(cluster.http_url, timeout=120).generate(p, max_new_tokens=max_new, grammar=grammar)
        for p in prompts
    ]

    async def one(client: TGIAsyncClient, prompt: str, started: asyncio.Event) -> str:
        text = ""
        async for response in client.generate_stream(prompt, max_new_tokens=max_new, grammar=grammar):
            text += response.token.text
            if len(text) > 10:
                started.set()
            if response.generated_text is not None:
                return response.generated_text
        return text

    async def kill_a_busy_decode_replica(tasks: list[asyncio.Task[str]]) -> int:
        while not all(t.done() for t in tasks):
            listed = await asyncio.to_thread(grpcurl, cluster.admin_address, "ListReplicas")
            holding = [
                r
                for r in listed["replicas"]
                if r["role"] == "REPLICA_ROLE_DECODE" and int(r.get("requests", 0)) > 0
            ]
            if holding:
                victim = int(max(holding, key=lambda r: int(r.get("requests", 0))).get("id", 0))
                cluster.replicas[victim].popen.kill()
                return victim
        pytest.fail("every stream ended before a decode replica was seen holding it: nothing was killed")

    async def main() -> tuple[list[str], int]:
        client = TGIAsyncClient(cluster.http_url, timeout=120)
        started = asyncio.Event()
        tasks = [asyncio.create_task(one(client, p, started)) for p in prompts]
        await asyncio.wait_for(started.wait(), 60)
        victim = await kill_a_busy_decode_replica(tasks)
        return list(await asyncio.gather(*tasks)), victim

    before = int(grpcurl(cluster.admin_address, "Stats").get("requests_requeued", 0))
    results, victim = asyncio.run(main())
    assert int(grpcurl(cluster.admin_address, "Stats").get("requests_requeued", 0)) > before
    for text, ref in zip(results, reference, strict=True):
        jsonschema.validate(json.loads(text), LONG)
        assert text == ref.generated_text  # greedy: the re-run continues exactly where the dead run stopped
    # back to 1 prefill + 2 decode for what follows (this thread outlives the replica: see restart_replica)
    cluster.replicas[victim].popen.wait(timeout=30)
    cluster.wait_replica(cluster.restart_replica(victim))

    def back() -> bool:
        listed = grpcurl(cluster.admin_address, "ListReplicas")["replicas"]
        return next(r for r in listed if int(r.get("id", 0)) == victim)["role"] == "REPLICA_ROLE_DECODE"

    eventually(back, 60, interval=0.5, message=f"replica {victim} serving as a decode replica again")


WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize("strategy", [Strategy.FULL.value, Strategy.RECOMPUTE.value])
def test_forced_tool_calls_through_the_openai_sdk(cluster: LocalCluster, strategy: str) -> None:
    set_strategy(cluster, strategy)
    client: Any = _client(cluster)  # the SDK's TypedDicts: these tests send plain dicts
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced: list[tuple[Any, str | None]] = [
        ("required", None),
        ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
    ]
    for choice_arg, name in forced:
        done = client.chat.completions.create(
            model=_model(client),
            messages=messages,
            tools=[WEATHER, TIME],
            tool_choice=choice_arg,
            max_tokens=MAX_NEW,
            temperature=0,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        call = choice.message.tool_calls[0]
        assert name is None or call.function.name == name
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        # streamed: the deltas add up to the same call
        stream = client.chat.completions.create(
            model=_model(client),
            messages=messages,
            tools=[WEATHER, TIME],
            tool_choice=choice_arg,
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
        )
        names, arguments, reasons = [], "", []
        for chunk in stream:
            delta = chunk.choices[0].delta
            for part in delta.tool_calls or []:
                assert part.index == 0
                names += [part.function.name] if part.function and part.function.name else []
                arguments += part.function.arguments or "" if part.function else ""
            reasons.append(chunk.choices[0].finish_reason)
        assert names == [call.function.name] and arguments == call.function.arguments
        assert reasons[-1] == "tool_calls"
    # the call and its result go back into the conversation (role "tool"), and the model answers
    follow = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = client.chat.completions.create(
        model=_model(client), messages=follow, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage is not None and answer.usage.prompt_tokens > done.usage.prompt_tokens


def test_tool_refusals(cluster: LocalCluster) -> None:
    client: Any = _client(cluster)  # the SDK's TypedDicts: these tests send plain dicts
    messages: list[Any] = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=_model(client),
            messages=messages,
            tools=[TIME],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=_model(client), messages=messages, tool_choice="required")
    assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]
