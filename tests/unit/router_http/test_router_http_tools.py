"""Tool calling's pure parts: planning tools / tool_choice (and its 400s), parsing calls out of an
output, streaming them as deltas, the tiny model's template with tools; structured output's 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdcluster.tools.tiny_model import CHAT_TEMPLATE
from router.http.errors import APIError
from router.http.schemas import ChatCompletionRequest, ResponseFormat, TGIGrammar, Tool
from router.http.structured import openai_grammar, tgi_grammar
from router.http.tools import ToolMode, ToolStream, finished_message, parse_calls, plan_tools
from router.tokenizer import _compile_template
from router.types import GrammarKind

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]


def _refused(param: str, fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as refused:
        fn(*args)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
    return refused.value


def test_tool_choice_modes_and_their_grammars() -> None:
    assert plan_tools(None, None, None).mode is ToolMode.NONE
    assert plan_tools(TOOLS, None, None).mode is ToolMode.AUTO
    assert plan_tools(TOOLS, "none", None).mode is ToolMode.NONE
    required = plan_tools(TOOLS, "required", None)
    assert required.mode is ToolMode.FORCED and required.grammar is not None
    schema = json.loads(required.grammar.text)
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather", "get_time"]
    named = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        }
    )
    plan = plan_tools(named.tools, named.tool_choice, None)
    assert plan.grammar is not None and json.loads(plan.grammar.text)["properties"]["name"] == {
        "const": "get_time"
    }
    assert plan.tools[0]["function"]["name"] == "get_weather"  # the template still sees every tool


def test_tool_refusals_name_the_field() -> None:
    _refused("tool_choice", plan_tools, None, "required", None)
    _refused("tools", plan_tools, [TOOLS[0], TOOLS[0]], None, None)
    missing = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [TIME],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        }
    )
    _refused("tool_choice", plan_tools, missing.tools, missing.tool_choice, None)
    _refused("response_format", plan_tools, TOOLS, "required", ResponseFormat(type="json_object"))
    bad = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
    )
    assert "bogus" in _refused("tools", plan_tools, [bad], "required", None).message


def test_calls_parsed_from_forced_and_auto_outputs() -> None:
    forced = plan_tools(TOOLS, "required", None)
    content, calls = parse_calls(forced, '{"name":"get_weather","arguments":{"city":"Rome"}}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Rome"}'}
    assert parse_calls(forced, '{"name":"get_weather","argu') == (
        '{"name":"get_weather","argu',
        [],
    )  # cut short
    auto = plan_tools(TOOLS, "auto", None)
    text = 'Let me look. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_calls(auto, text + '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_time"]
    assert parse_calls(auto, "no call here") == ("no call here", [])
    two = text + '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    assert len(parse_calls(auto, two)[1]) == 2
    assert [c["function"]["name"] for c in parse_calls(plan_tools(TOOLS, "auto", None, False), two)[1]] == [
        "get_time"
    ]
    message, reason = finished_message(auto, text, "stop")
    assert reason == "tool_calls" and message["tool_calls"][0]["id"].startswith("call_")
    assert finished_message(auto, "plain", "length") == ({"role": "assistant", "content": "plain"}, "length")


def _stream(plan_choice: str, text: str, step: int) -> tuple[str, list[dict[str, Any]], bool]:
    stream = ToolStream(plan_tools(TOOLS, plan_choice, None))
    content, deltas = "", list[dict[str, Any]]()
    for i in range(0, len(text), step):
        piece, more = stream.push(text[i : i + step])
        content, deltas = content + piece, deltas + more
    piece, more = stream.finish("")
    return content + piece, deltas + more, stream.called


@pytest.mark.parametrize("step", [1, 3, 7, 100])
def test_streamed_deltas_add_up_to_the_whole_answer(step: int) -> None:
    spaced = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for forced in ('{"name":"get_weather","arguments":{"city":"Paris"}}', spaced):
        content, deltas, called = _stream("required", forced, step)
        assert content == "" and called
        assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
        assert deltas[0]["id"].startswith("call_")
        arguments = "".join(d["function"]["arguments"] for d in deltas)
        assert arguments == forced[forced.index("{", 1) : -1]
        _, calls = parse_calls(plan_tools(TOOLS, "required", None), forced)
        assert calls[0]["function"]["arguments"] == arguments  # streamed = whole
    auto = 'Sure <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, deltas, called = _stream("auto", auto, step)
    assert content.strip() == "Sure" and called and [d["function"]["name"] for d in deltas] == ["get_time"]
    text = "a < b <tool_ and <tool_call> not json </tool_call> end"  # looks like a call, is not one
    assert _stream("auto", text, step) == (text, [], False)


def test_tiny_template_renders_tools_calls_and_results_and_nothing_new_without_them() -> None:
    template = _compile_template(CHAT_TEMPLATE)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = template.render(messages=plain, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert rendered == "<s><|user|>\nhi</s>\n<|assistant|>\nyo</s>\n<|assistant|>\n"
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}}
    history = [
        *plain,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "noon"},
    ]
    rendered = template.render(
        messages=history, add_generation_prompt=True, bos_token="", eos_token="", tools=[WEATHER]
    )
    assert (
        '"name": "get_weather"' in rendered
        and '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' in rendered
    )
    assert "<|tool|>\nnoon" in rendered


def test_response_format_and_tgi_grammar_refusals() -> None:
    assert openai_grammar(None) is None and openai_grammar(ResponseFormat(type="text")) is None
    assert openai_grammar(ResponseFormat(type="json_object")).kind is GrammarKind.JSON_OBJECT  # type: ignore[union-attr]
    _refused("response_format.json_schema.schema", openai_grammar, ResponseFormat(type="json_schema"))
    bad = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}
    )
    _refused("response_format.json_schema.schema", openai_grammar, bad)
    assert tgi_grammar(TGIGrammar(type="json", value='{"type": "object"}')).kind is GrammarKind.JSON_SCHEMA  # type: ignore[union-attr]
    _refused("grammar.value", tgi_grammar, TGIGrammar(type="json", value="not json"))
    _refused("grammar.value", tgi_grammar, TGIGrammar(type="regex", value={"a": 1}))
    _refused("grammar.value", tgi_grammar, TGIGrammar(type="regex", value="[z-a]"))
