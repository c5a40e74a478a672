"""Tool calling in chat completions: tools go to the chat template, calls come out as `tool_calls`.

```
 tool_choice  output (the chat template gets the tools in every case)  grammar
 none         text                                                none
 auto         text; <tool_call>{"name", "arguments"}</tool_call>  none (the model decides)
              blocks in it become tool_calls
 required     one call of one of the tools                        {"name": one of them, "arguments": ...}
 named        one call of that function                           {"name": it, "arguments": its params}
```

`tool_choice` absent means auto when tools are given. A forced call (required / named) is enforced by
the same grammar engine as `response_format` (router/grammar.py, then the replicas' masks), so its
arguments validate against the function's parameters; the answer carries it in `tool_calls` with
`finish_reason: "tool_calls"` and no content. Calls are streamed as deltas (`ToolStream`): a forced
call's name as soon as it is known, then its arguments as they are generated; auto mode holds text
back from a possible `<tool_call>` on and sends the calls it held when the request finishes.
Messages may carry earlier calls (assistant `tool_calls`) and their results (`role: "tool"`).
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.http.errors import APIError, Flavor
from router.http.schemas import ChatMessage, NamedToolChoice, ResponseFormat, Tool, ToolCall
from router.http.structured import schema_grammar
from router.types import Grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# a forced call's JSON up to its arguments (the grammar writes "name" first, then "arguments")
_FORCED_HEAD = re.compile(r'^\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
_AUTO_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


class ToolMode(enum.Enum):
    """How the output relates to the tools."""

    NONE = "none"  # text only
    AUTO = "auto"  # text, calls parsed out of it
    FORCED = "forced"  # exactly one call (required / named), grammar-enforced


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its answer."""

    mode: ToolMode
    tools: tuple[dict[str, Any], ...] = ()  # as the chat template receives them (OpenAI's shape)
    names: frozenset[str] = frozenset()
    grammar: Grammar | None = None
    parallel: bool = True  # auto mode may return several calls (parallel_tool_calls false: the first)


NO_TOOLS = ToolPlan(ToolMode.NONE)


def plan_tools(
    tools: Sequence[Tool] | None,
    choice: str | NamedToolChoice | None,
    response_format: ResponseFormat | None,
    parallel: bool | None = None,
) -> ToolPlan:
    """Check `tools` / `tool_choice` (400s naming the field) and plan the request (`parallel`:
    `parallel_tool_calls`, default true)."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError("`tool_choice` needs `tools`", 400, param="tool_choice")
        return NO_TOOLS
    functions = {t.function.name: t.function.parameters or _ANY_OBJECT for t in tools}
    if len(functions) < len(tools):
        raise APIError("two tools have the same function name", 400, param="tools")
    template_tools = tuple(t.model_dump(exclude_none=True) for t in tools)
    names = frozenset(functions)
    if choice in (None, "auto", "none"):
        mode = ToolMode.NONE if choice == "none" else ToolMode.AUTO
        return ToolPlan(mode, template_tools, names, parallel=parallel is not False)
    if response_format is not None and response_format.type != "text":
        raise APIError("a forced tool call cannot have a response_format too", 400, param="response_format")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise APIError(f"tool_choice names {name!r}, which is not in `tools`", 400, param="tool_choice")
        functions = {name: functions[name]}
    grammar = schema_grammar(call_schema(functions), Flavor.OPENAI, "tools")
    return ToolPlan(ToolMode.FORCED, template_tools, names, grammar)


def call_schema(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON Schema of one call of one of `functions` (name → parameters schema)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
        }
        for name, parameters in functions.items()
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them (arguments of earlier calls as objects, as in
    transformers' convention; text that is not JSON stays text)."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.function.name, "arguments": _loads(call.function.arguments)}
    return {"id": call.id, "type": call.type, "function": function}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of `tool_calls` (`arguments`: JSON text)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished output; no calls when it holds none that parse."""
    if plan.mode is ToolMode.FORCED:
        call, head = _call_of(text, plan.names), _FORCED_HEAD.match(text)
        if call is None:
            return text, []
        # the arguments exactly as generated (and as streamed), when the output has the grammar's shape
        arguments = text[head.end() : -1] if head else _dumps(call[1])
        return None, [new_call(call[0], arguments)]
    if plan.mode is ToolMode.NONE or CALL_OPEN not in text:
        return text, []
    calls = [c for c in (_call_of(m.group(1).strip(), plan.names) for m in _AUTO_CALL.finditer(text)) if c]
    if not calls:
        return text, []
    calls = calls if plan.parallel else calls[:1]
    content = _AUTO_CALL.sub("", text).strip()
    return content or None, [new_call(name, _dumps(arguments)) for name, arguments in calls]


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _call_of(text: str, names: frozenset[str]) -> tuple[str, Any] | None:
    """(name, arguments) of `{"name": ..., "arguments": ...}` naming one of `names`, else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def finished_message(plan: ToolPlan, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """The non-streamed answer's `message` and `finish_reason`."""
    content, calls = parse_calls(plan, text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


class ToolStream:
    """Splits a streamed output into content pieces and `tool_calls` deltas (see the module doc)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything generated so far
        self.sent = 0  # text[:sent] has gone out (as content, or as the forced call's head and arguments)
        self.calls = 0  # calls announced
        self.holding = False  # auto: a <tool_call> began; the rest waits for the finish

    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """Content to send now and tool-call deltas, after `piece` was generated."""
        self.text += piece
        if self.plan.mode is ToolMode.FORCED:
            return "", self._forced(final=False)
        if self.plan.mode is ToolMode.NONE:
            return self._release(len(self.text)), []
        if not self.holding and CALL_OPEN in self.text[self.sent :]:
            self.holding = True
            return self._release(self.text.index(CALL_OPEN, self.sent)), []
        if self.holding:
            return "", []
        return self._release(len(self.text) - _partial_open(self.text[self.sent :])), []

    def finish(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """The rest of the content and the remaining deltas at the end of the output."""
        self.text += piece
        if self.plan.mode is ToolMode.FORCED:
            return "", self._forced(final=True)
        if self.plan.mode is ToolMode.NONE or not self.holding:
            return self._release(len(self.text)), []
        content, calls = parse_calls(self.plan, self.text[self.sent :])
        if not calls:
            return self._release(len(self.text)), []
        self.sent = len(self.text)
        deltas = []
        for call in calls:
            deltas.append({"index": self.calls, **call})
            self.calls += 1
        return content or "", deltas

    @property
    def called(self) -> bool:
        """Whether any call was sent (the finish reason is then "tool_calls")."""
        return self.calls > 0

    def _release(self, upto: int) -> str:
        piece = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return piece

    def _forced(self, final: bool) -> list[dict[str, Any]]:
        deltas = []
        if not self.calls:
            head = _FORCED_HEAD.match(self.text)
            if head is None:
                return []
            call = new_call(json.loads(head.group(1)), "")
            deltas.append({"index": 0, **call})
            self.calls, self.sent = 1, head.end()
        # the call object's closing brace is not part of the arguments: hold the last character back
        end = (
            len(self.text) - 1 if final and self.text.endswith("}") else len(self.text) - (0 if final else 1)
        )
        fragment = self._release(end)
        if fragment:
            deltas.append({"index": 0, "function": {"arguments": fragment}})
        return deltas


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that could begin `<tool_call>` (held back until known)."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
