"""Request bodies of the OpenAI and TGI routes (pydantic, strict: wrong types are refused, not coerced).

Strict mode keeps `"max_tokens": "5"` or `"stream": "yes"` from silently meaning something; NaN
and infinities are refused everywhere. Unknown fields are ignored, as the upstream APIs do.
Range checks that need the model's limits (prompt length, max_tokens) live in `validation.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    """OpenAI's `stream_options`."""

    include_usage: bool = False


class _OpenAISampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    """A text part of a chat message's content list."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message; content is text or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class TGIParameters(_Strict):
    """TGI's `parameters` object (the text-generation client sends every field, mostly null)."""

    do_sample: bool = False
    max_new_tokens: int | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    return_full_text: bool | None = False
    stop: list[str] = Field(default_factory=list)
    seed: Seed | None = None
    temperature: Annotated[float, Field(gt=0.0)] | None = None
    top_k: Annotated[int, Field(gt=0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    truncate: Annotated[int, Field(gt=0)] | None = None
    typical_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    best_of: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: Annotated[int, Field(ge=0)] | None = None
    grammar: Any | None = None


class TGIRequest(_Strict):
    """POST /generate, /generate_stream and / (TGI's compat route)."""

    inputs: Annotated[str, Field(min_length=1)]
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False
