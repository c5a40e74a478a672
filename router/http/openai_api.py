"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from router.http.common import (
    backend_of,
    backends_of,
    finish_all,
    gone_response,
    model_backend,
    new_request_id,
    start,
)
from router.http.errors import APIError, Flavor, error_body
from router.http.events import ClientGone, EventFeed, EventStreamResponse, failed_event, sse
from router.http.openai_format import OpenAIAnswer, OpenAIContext
from router.http.responses import dumps, json_response
from router.http.samples import merged, sample_requests, start_samples, summed_usage
from router.http.schemas import ChatCompletionRequest, CompletionRequest
from router.http.structured import openai_grammar
from router.http.tools import (
    NO_TOOLS,
    ToolMode,
    ToolPlan,
    ToolStream,
    finished_message,
    plan_tools,
    template_messages,
)
from router.http.validation import (
    check_max_new_range,
    check_min_tokens,
    check_openai_unsupported,
    check_prompt,
    generate_request,
    max_new_tokens,
    openai_sampling,
    parse_body,
    stop_sequences,
)
from router.tokenizer import ChatTemplateError
from router.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateRequest,
    PrefillEvent,
    StoppingParams,
    TokenEvent,
)

OPENAI = Flavor.OPENAI
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """Every served model, the default one first."""
    models = [
        {
            "id": info.model_id,
            "object": "model",
            "created": info.created,
            "owned_by": "pdcluster",
            "root": info.model_root or info.model_id,
            "parent": None,
            "max_model_len": info.max_total_tokens,
        }
        for info in (b.info for b in backends_of(request).values())
    ]
    return json_response({"object": "list", "data": models})


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """Text completion of one prompt (text or token ids), streamed or not."""
    backend = backend_of(request)
    body = parse_body(await request.body(), CompletionRequest, OPENAI, backend.info.ignore_unknown_fields)
    backend = model_backend(request, body.model)
    check_openai_unsupported(body)
    if body.best_of not in (None, 1):
        raise APIError("only best_of=1 is supported", 400, param="best_of")
    if body.suffix:
        raise APIError("suffix is not supported by this server", 400, param="suffix")
    text, raw_ids = _completion_prompt(body.prompt, request)
    ids = check_prompt(raw_ids, backend.info, backend.tokenizer.vocab_size, OPENAI)
    if text is None:  # token ids: decoded only once they are known to be in the vocabulary
        text = backend.tokenizer.decode(list(ids), skip_special_tokens=False) if body.echo else ""
    default = max(COMPLETIONS_DEFAULT_MAX_TOKENS, body.min_tokens)  # a default never undercuts min_tokens
    max_new = max_new_tokens(body.max_tokens, default, len(ids), backend.info, OPENAI, "max_tokens")
    min_new = check_min_tokens(body.min_tokens, max_new)
    stops = stop_sequences(body.stop, backend.info, OPENAI)
    want_logprobs = body.logprobs is not None
    req = generate_request(
        ids,
        openai_sampling(body, backend.tokenizer.vocab_size),
        StoppingParams(max_new, stops, body.ignore_eos, min_new),
        prefill_logprobs=body.echo and want_logprobs,
        top_n_tokens=body.logprobs or 0,
        grammar=openai_grammar(body.response_format),
    )
    ctx = _context(request, "cmpl", False, stops, want_logprobs, body.stream, body.stream_options)
    if body.echo:
        ctx = OpenAIContext(**{**ctx.__dict__, "echo": text})
    return await _answer(request, req, ctx, body.stream, n=body.n)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """Chat completion: messages rendered with the checkpoint's chat template, streamed or not."""
    backend = backend_of(request)
    body = parse_body(await request.body(), ChatCompletionRequest, OPENAI, backend.info.ignore_unknown_fields)
    backend = model_backend(request, body.model)
    check_openai_unsupported(body)
    tools = plan_tools(body.tools, body.tool_choice, body.response_format, body.parallel_tool_calls)
    if tools.tools and not backend.tokenizer.supports_tools:
        raise APIError("this model's chat template does not render tools", 400, param="tools")
    messages = template_messages(body.messages)
    try:
        prompt = backend.tokenizer.apply_chat_template(
            messages, body.add_generation_prompt, tools=tools.tools or None
        )
    except ChatTemplateError as exc:
        raise APIError(str(exc), 400, param="messages") from exc
    ids = check_prompt(
        backend.tokenizer.encode(prompt, add_special_tokens=False),
        backend.info,
        backend.tokenizer.vocab_size,
        OPENAI,
        "messages",
    )
    asked, param = (
        (body.max_completion_tokens, "max_completion_tokens")
        if body.max_completion_tokens is not None
        else (body.max_tokens, "max_tokens")
    )
    if param == "max_completion_tokens":  # the one that loses is still held to its range
        check_max_new_range(body.max_tokens, backend.info, OPENAI, "max_tokens")
    default = max(backend.info.default_max_new_tokens, body.min_tokens)  # never undercuts min_tokens
    max_new = max_new_tokens(asked, default, len(ids), backend.info, OPENAI, param)
    min_new = check_min_tokens(body.min_tokens, max_new)
    stops = stop_sequences(body.stop, backend.info, OPENAI)
    top_n = (body.top_logprobs or 0) if body.logprobs else 0
    req = generate_request(
        ids,
        openai_sampling(body, backend.tokenizer.vocab_size),
        StoppingParams(max_new, stops, body.ignore_eos, min_new),
        top_n_tokens=top_n,
        grammar=tools.grammar or openai_grammar(body.response_format),
    )
    ctx = _context(request, "chatcmpl", True, stops, body.logprobs, body.stream, body.stream_options)
    return await _answer(request, req, ctx, body.stream, tools, body.n)


def _completion_prompt(
    prompt: str | list[int] | list[str] | list[list[int]], request: Request
) -> tuple[str | None, list[int]]:
    """One prompt's text (None when given as token ids) and token ids; several prompts in one
    request are refused (like n > 1)."""
    tokenizer = backend_of(request).tokenizer
    if not prompt or prompt == [""]:
        raise APIError("the prompt is empty", 400, param="prompt")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    first = prompt[0]
    if isinstance(first, int):
        return None, [t for t in prompt if isinstance(t, int)]
    if len(prompt) != 1:
        raise APIError("only one prompt per request is supported", 400, param="prompt")
    if isinstance(first, str):
        return first, tokenizer.encode(first)
    return None, list(first)


def _context(
    request: Request,
    prefix: str,
    chat: bool,
    stops: tuple[str, ...],
    logprobs: bool,
    stream: bool,
    options: object,
) -> OpenAIContext:
    info = backend_of(request).info
    include_usage = bool(stream and getattr(options, "include_usage", False))
    return OpenAIContext(
        request_id=new_request_id(prefix),
        model=info.model_id,
        created=int(time.time()),
        chat=chat,
        stops=stops,
        logprobs=logprobs,
        include_usage=include_usage,
        fingerprint=f"pdcluster-{info.version}",
    )


async def _answer(
    request: Request,
    req: GenerateRequest,
    ctx: OpenAIContext,
    stream: bool,
    tools: ToolPlan = NO_TOOLS,
    n: int = 1,
) -> Response:
    if n > 1:
        return await _answer_samples(request, req, ctx, stream, tools, n)
    try:
        feed, first = await start(request, req, OPENAI)
    except ClientGone:
        return gone_response()
    answer = OpenAIAnswer(ctx)
    if stream:
        calls = None if tools.mode is ToolMode.NONE else ToolStream(tools)
        return EventStreamResponse(
            _stream(answer, first, feed, calls), feed, {"x-request-id": ctx.request_id}
        )
    try:
        events = await finish_all(request, feed, first, OPENAI)
    except ClientGone:
        return gone_response()
    for event in events:
        _fold(answer, event)
    final = _final_object(answer, tools)
    headers = {"x-request-id": ctx.request_id, "x-pdcluster-route": dumps(final["pdcluster_route"])}
    return json_response(final, headers=headers)


def _final_object(answer: OpenAIAnswer, tools: ToolPlan) -> dict[str, Any]:
    """The answer's whole object; with tools, its message carries the parsed calls."""
    final = answer.final_object()
    if tools.mode is not ToolMode.NONE:
        choice = final["choices"][0]
        choice["message"], choice["finish_reason"] = finished_message(
            tools, answer.text, choice["finish_reason"]
        )
    return final


async def _answer_samples(
    request: Request, req: GenerateRequest, ctx: OpenAIContext, stream: bool, tools: ToolPlan, n: int
) -> Response:
    """n samples of one prompt (samples.py): one object with n choices, or one interleaved stream."""
    try:
        group, firsts = await start_samples(request, sample_requests(req, n), OPENAI)
    except ClientGone:
        return gone_response()
    answers = [OpenAIAnswer(ctx) for _ in range(n)]
    if stream:
        streams = [
            _stream(
                answer, first, feed, None if tools.mode is ToolMode.NONE else ToolStream(tools), last=False
            )
            for answer, first, feed in zip(answers, firsts, group.feeds, strict=True)
        ]
        return EventStreamResponse(_samples_stream(answers, streams), group, {"x-request-id": ctx.request_id})
    finals = []
    try:
        for answer, first, feed in zip(answers, firsts, group.feeds, strict=True):
            for event in await finish_all(request, feed, first, OPENAI):
                _fold(answer, event)
            finals.append(_final_object(answer, tools))
    except ClientGone:
        await group.close()
        return gone_response()
    except APIError:
        await group.close()
        raise
    whole = finals[0]
    whole["choices"] = [{**final["choices"][0], "index": i} for i, final in enumerate(finals)]
    whole["usage"] = summed_usage([final["usage"] for final in finals])
    headers = {"x-request-id": ctx.request_id, "x-pdcluster-route": dumps(whole["pdcluster_route"])}
    return json_response(whole, headers=headers)


async def _samples_stream(
    answers: list[OpenAIAnswer], streams: list[AsyncIterator[str]]
) -> AsyncIterator[str]:
    """The samples' chunks interleaved, then (every sample finished) the usage chunk and [DONE]; a
    sample that failed ended its part with its error event, and the stream ends without [DONE]."""
    async for chunk in merged(streams):
        yield chunk
    if any(answer.finish is None for answer in answers):
        return
    tail = ""
    if answers[0].ctx.include_usage:
        body = answers[0].usage_chunk()
        body["usage"] = summed_usage([answer.usage() for answer in answers])
        tail = sse(dumps(body))
    yield tail + sse("[DONE]")


def _fold(answer: OpenAIAnswer, event: Event) -> str:
    if isinstance(event, PrefillEvent):
        answer.on_prefill(event)
    elif isinstance(event, TokenEvent):
        return answer.on_token(event)
    elif isinstance(event, FinishEvent):
        return answer.on_finish(event)
    return ""


async def _stream(
    answer: OpenAIAnswer, first: Event, feed: EventFeed, calls: ToolStream | None = None, last: bool = True
) -> AsyncIterator[str]:
    """SSE chunks: (role | echo), one per token, the finish with the route, (usage), [DONE]; with
    tools, content pieces and tool-call deltas as `calls` splits them. `last=False` (one sample of
    several) leaves the usage and [DONE] to the caller."""
    ctx = answer.ctx
    if ctx.chat:
        yield sse(dumps(answer.chunk("", [], role=True)))
    elif ctx.echo:
        yield sse(dumps(answer.chunk(ctx.echo, [])))
    event: Event | None = first
    try:
        while event is not None:
            if isinstance(event, ErrorEvent):
                yield failed_event(event, OPENAI)
                return
            piece = _fold(answer, event)
            if isinstance(event, FinishEvent):
                # One write for the finish, the usage and [DONE]: they are ready together.
                if not last:
                    yield _finish_with_calls(answer, piece, calls)
                    return
                usage = sse(dumps(answer.usage_chunk())) if ctx.include_usage else ""
                yield _finish_with_calls(answer, piece, calls) + usage + sse("[DONE]")
                return
            if calls is not None and isinstance(event, TokenEvent):
                piece, deltas = calls.push(piece)
                if deltas:
                    yield _tool_chunk(answer, deltas)
            if isinstance(event, TokenEvent) and (piece or ctx.logprobs):
                yield sse(answer.token_chunk_json(piece, event.token))
            event = await feed.next()
        yield sse(dumps(error_body("the scheduler ended the stream without finishing it", 500, OPENAI)))
    except APIError as exc:
        yield sse(dumps(exc.body()))
    except Exception as exc:  # a scheduler bug must still end the stream with a reason
        yield sse(dumps(error_body(f"internal error: {exc!r}", 500, OPENAI)))


def _tool_chunk(answer: OpenAIAnswer, deltas: list[dict[str, Any]]) -> str:
    """A chunk whose delta carries tool calls (their first delta has id, type and name)."""
    body = answer.chunk("", [])
    body["choices"][0]["delta"] = {"tool_calls": deltas}
    return sse(dumps(body))


def _finish_with_calls(answer: OpenAIAnswer, piece: str, calls: ToolStream | None) -> str:
    """The last content and tool-call deltas, then the finish chunk ("tool_calls" once a call went out)."""
    if calls is None:
        return sse(dumps(answer.final_chunk(piece)))
    piece, deltas = calls.finish(piece)
    final = answer.final_chunk(piece)
    if calls.called:
        final["choices"][0]["finish_reason"] = "tool_calls"
    return (_tool_chunk(answer, deltas) if deltas else "") + sse(dumps(final))
