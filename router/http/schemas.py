"""Request bodies of the OpenAI and TGI routes (pydantic, strict: wrong types are refused, not coerced).

Strict mode keeps `"max_tokens": "5"` or `"stream": "yes"` from silently meaning something; NaN
and infinities are refused everywhere. No field is silently dropped: a field these models do not
name is refused with a 400 naming it (`extra="forbid"`; the router's `--ignore-unknown-fields`
drops them instead, for clients that send extras: `validation.parse_body`). JSON has
one number type, so a whole number written `5.0` is the integer 5 (as JSON Schema says; `5.5` is
refused).
Range checks that need the model's limits (prompt length, max_tokens) live in `validation.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _whole_number(value: object) -> object:
    """`5.0` → 5: the schema's "integer" admits it (JSON Schema); `5.5`, `"5"`, `true` stay refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Bounds go before the validator, so that they reach the JSON schema (pydantic writes bounds given
# after a validator as unknown `gt`/`ge` keywords).
WHOLE = BeforeValidator(_whole_number)
Int = Annotated[int, WHOLE]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1), WHOLE]
MAX_SAMPLES = 16  # `n`: samples of one prompt in one request


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Strict):
    """OpenAI's `stream_options`."""

    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`: the schema the output must validate against."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _OpenAISampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Int | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1), WHOLE] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES), WHOLE] = 1  # samples of the prompt (samples.py)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0), WHOLE] = 0
    user: str | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[Int] | list[str] | list[list[Int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20), WHOLE] | None = None
    best_of: Int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    """A text part of a chat message's content list."""

    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    """The function of a tool call: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Strict):
    """A tool call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    """One chat message; content is text or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    """A function the model may call: its name, what it does, its parameters as a JSON Schema."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    """The function a named `tool_choice` forces."""

    name: str


class NamedToolChoice(_Strict):
    """`tool_choice` naming one function: the model must call it."""

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), WHOLE] | None = None
    max_completion_tokens: Int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TGIGrammar(_Strict):
    """TGI's `grammar`: `{"type": "json", "value": <JSON Schema>}` or `{"type": "regex", "value": "..."}`."""

    type: Literal["json", "regex"]
    value: dict[str, Any] | str


class TGIParameters(_Strict):
    """TGI's `parameters` object (the text-generation client sends every field, mostly null)."""

    do_sample: bool = False
    max_new_tokens: Int | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    return_full_text: bool | None = False
    stop: list[str] = Field(default_factory=list)
    seed: Seed | None = None
    temperature: Annotated[float, Field(gt=0.0)] | None = None
    top_k: Annotated[int, Field(gt=0), WHOLE] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    truncate: Annotated[int, Field(gt=0), WHOLE] | None = None
    typical_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    best_of: Int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: Annotated[int, Field(ge=0), WHOLE] | None = None
    grammar: TGIGrammar | None = None


class TGIRequest(_Strict):
    """POST /generate, /generate_stream and / (TGI's compat route)."""

    inputs: Annotated[str, Field(min_length=1)]
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False
    # pdcluster extension (TGI serves one model): which of the router's models; absent = the default
    model: str | None = None


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize (vLLM): the ids of a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """POST /tokenize (vLLM): the ids of messages rendered by the chat template."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TGITokenizeParameters(_Strict):
    """The one parameter TGI's /tokenize applies: `truncate` keeps the last tokens."""

    truncate: Annotated[int, Field(gt=0), WHOLE] | None = None


class TGITokenizeRequest(_Strict):
    """POST /tokenize (TGI): the tokens of `inputs` with their character offsets."""

    inputs: Annotated[str, Field(min_length=1)]
    parameters: TGITokenizeParameters | None = None


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM): the text of token ids."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0), WHOLE]]
