"""The shapes of every answer, for the OpenAPI schema (`openapi.py`) and what /docs shows.

The routes build their answers as plain dicts (`openai_format.py`, `tgi_format.py`, pure and fast);
these models describe them exactly (`extra="forbid"`: a field the routes add must be added here too,
or the schema tests fail). Fields without a default are always present, `| None` ones may be null.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Route(_Answer):
    """Where the request ran (pdcluster's extension): replicas, migration strategy, KV bytes moved."""

    prefill_replica: int | None
    decode_replica: int | None
    strategy: str
    migration_bytes: int
    migration_seconds: float
    loading_prefill: bool = Field(description="prefilled (at least its first layers) by a replica still "
                                              "receiving its weights (live scaling)")
    relay_replica: int | None = Field(description="the loaded replica that finished such a prefill")
    requeues: int = Field(description="times it ran again on another replica after a replica failed")
    cached_tokens: int = Field(0, description="prompt tokens its prefill found in the replica's prefix cache")


class PromptTokensDetails(_Answer):
    """What OpenAI and vLLM say of the prompt's tokens."""

    cached_tokens: int = Field(description="prompt tokens the prefill took from the prefix cache")


class Usage(_Answer):
    """Tokens of the prompt and of the completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Answer):
    """Per-token logprobs of a completion choice (with `echo`, the prompt's tokens first)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


FinishReason = Literal["stop", "length"]


class CompletionChoice(_Answer):
    """The one choice of a completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class _Envelope(_Answer):
    id: str
    created: int
    model: str
    system_fingerprint: str


class Completion(_Envelope):
    """POST /v1/completions, not streamed."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage
    pdcluster_route: Route


class CompletionChunkChoice(_Answer):
    """A streamed completion choice: `finish_reason` only on the last chunk with a choice."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionChunk(_Envelope):
    """One SSE event of a streamed completion (then `data: [DONE]`); with `include_usage`, every
    chunk has `usage: null` and an extra last chunk has no choices and the usage."""

    object: Literal["text_completion"]
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    pdcluster_route: Route | None = None


class TopLogprob(_Answer):
    """An alternative token of a chat logprob."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    """One generated token's logprob and its alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Answer):
    """A chat choice's logprobs."""

    content: list[ChatTokenLogprob]


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class FunctionCall(_Answer):
    """The function a tool call calls: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Answer):
    """One tool call of the answer (`finish_reason` is then "tool_calls")."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Answer):
    """The generated message: text, or tool calls (content null when the output was only calls)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Answer):
    """The one choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason


class ChatCompletion(_Envelope):
    """POST /v1/chat/completions, not streamed."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage
    pdcluster_route: Route


class FunctionDelta(_Answer):
    """What a chunk adds to a tool call's function: its name (first delta), a piece of its arguments."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Answer):
    """A tool call's part in a chunk; its first delta carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(_Answer):
    """The text a chunk adds (the first chunk also names the role), or tool-call deltas."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Answer):
    """A streamed chat choice."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletionChunk(_Envelope):
    """One SSE event of a streamed chat completion (then `data: [DONE]`)."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    pdcluster_route: Route | None = None


class Model(_Answer):
    """The served model."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="the checkpoint the model was loaded from (vLLM's field: its "
                      "`bench serve` loads the tokenizer from it)")
    parent: str | None = Field(description="the model this one derives from (always null: no adapters)")
    max_model_len: int = Field(description="prompt + generated tokens one request may reach")


class Tokenized(_Answer):
    """POST /tokenize, vLLM's shapes."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="the vocabulary's string per id (`return_token_strs`)")


class Detokenized(_Answer):
    """POST /detokenize."""

    prompt: str


class TGISimpleToken(_Answer):
    """One token of TGI's /tokenize answer: its id, its text and its character offsets in `inputs`."""

    id: int
    text: str
    start: int
    stop: int


class ModelList(_Answer):
    """GET /v1/models."""

    object: Literal["list"]
    data: list[Model]


class TGIToken(_Answer):
    """A generated token (TGI)."""

    id: int
    text: str
    logprob: float
    special: bool


class TGIPrefillToken(_Answer):
    """A prompt token (TGI `decoder_input_details`); the first one has no logprob."""

    id: int
    text: str
    logprob: float | None


class TGIDetails(_Answer):
    """`details` of a TGI answer (when `parameters.details`)."""

    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    prefill: list[TGIPrefillToken]
    tokens: list[TGIToken]
    best_of_sequences: None
    top_tokens: list[list[TGIToken]] | None = None


class TGIGenerated(_Answer):
    """POST /generate (and each element of POST /'s list)."""

    generated_text: str
    details: TGIDetails | None = None
    pdcluster_route: Route


class TGIStreamDetails(_Answer):
    """`details` of the last stream event."""

    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    input_length: int


class TGIStreamEvent(_Answer):
    """One SSE event of /generate_stream: one per token; the last carries text, details and route."""

    index: int
    token: TGIToken
    top_tokens: list[TGIToken] | None
    generated_text: str | None
    details: TGIStreamDetails | None
    pdcluster_route: Route | None = None


class TGIInfo(_Answer):
    """GET /info."""

    model_id: str
    model_sha: str | None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_input_length: int
    max_total_tokens: int
    max_batch_total_tokens: int | None
    max_client_batch_size: int
    validation_workers: int
    vocab_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None


class Health(_Answer):
    """GET /health."""

    status: Literal["ok", "unavailable"]


class OpenAIErrorDetail(_Answer):
    """What went wrong; `param` names the offending field, `code` is machine-readable."""

    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(_Answer):
    """Every error of the /v1 routes."""

    error: OpenAIErrorDetail


class TGIError(_Answer):
    """Every error of the TGI routes (what the `text-generation` client parses)."""

    error: str
    error_type: str
