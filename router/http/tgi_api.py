"""TGI-compatible routes: /generate, /generate_stream, / (compat), /info."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from router.http.common import (
    backend_of,
    finish_all,
    gone_response,
    model_backend,
    new_request_id,
    start,
)
from router.http.errors import APIError, Flavor, error_body
from router.http.events import ClientGone, EventFeed, EventStreamResponse, failed_event, sse
from router.http.responses import dumps, json_response
from router.http.schemas import TGIRequest
from router.http.structured import tgi_grammar
from router.http.tgi_format import TGIContext, Timeline, generate_object, stream_object
from router.http.validation import (
    check_prompt,
    check_tgi_unsupported,
    generate_request,
    max_new_tokens,
    parse_body,
    stop_sequences,
    tgi_sampling,
)
from router.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateRequest,
    PrefillEvent,
    StoppingParams,
    TokenEvent,
    TokenInfo,
)

TGI = Flavor.TGI

router = APIRouter()


@dataclass(frozen=True)
class _Prepared:
    request: GenerateRequest
    ctx: TGIContext
    stream: bool
    stream_given: bool  # `stream` was in the body (not the default)


@router.get("/info")
async def info(request: Request) -> Response:
    """TGI's /info: the model and the limits this router enforces; `?model=NAME` (a pdcluster
    extension): another model this router serves (unknown: 404 in TGI's shape)."""
    backend = model_backend(request, request.query_params.get("model"), TGI)
    served = backend.info
    return json_response(
        {
            "model_id": served.model_id,
            "model_sha": None,
            "model_dtype": served.model_dtype,
            "model_device_type": served.model_device_type,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": served.max_concurrent_requests,
            "max_best_of": 1,
            "max_stop_sequences": served.max_stop_sequences,
            "max_input_tokens": served.max_input_tokens,
            "max_input_length": served.max_input_tokens,
            "max_total_tokens": served.max_total_tokens,
            "max_batch_total_tokens": served.max_batch_total_tokens,
            "max_client_batch_size": 1,
            "validation_workers": 1,
            "vocab_size": served.vocab_size or backend.tokenizer.vocab_size,
            "router": "pdcluster",
            "version": served.version,
            "sha": None,
            "docker_label": None,
        }
    )


@router.post("/generate")
async def generate(request: Request) -> Response:
    """Generate and answer once (TGI's single object)."""
    timeline = Timeline()
    prepared = _prepare(request, await request.body())
    if prepared.stream:
        raise APIError("`stream`: /generate answers once; stream from /generate_stream or /", 400, TGI)
    return await _generate(request, prepared, timeline, as_list=False)


@router.post("/generate_stream")
async def generate_stream(request: Request) -> Response:
    """Generate and stream one SSE event per token."""
    prepared = _prepare(request, await request.body())
    if not prepared.stream and prepared.stream_given:
        raise APIError("`stream`: /generate_stream always streams; answer once from /generate or /", 400, TGI)
    return await _stream_response(request, prepared)


@router.post("/")
async def compat(request: Request) -> Response:
    """TGI's compat route (what the `text-generation` client posts to): a list, or a stream."""
    timeline = Timeline()
    prepared = _prepare(request, await request.body())
    if prepared.stream:
        return await _stream_response(request, prepared)
    return await _generate(request, prepared, timeline, as_list=True)


def _prepare(request: Request, raw: bytes) -> _Prepared:
    body = parse_body(raw, TGIRequest, TGI, backend_of(request).info.ignore_unknown_fields)
    backend = model_backend(request, body.model, TGI)
    params = body.parameters
    check_tgi_unsupported(params, backend.info)
    ids = backend.tokenizer.encode(body.inputs)
    if params.truncate is not None:
        ids = ids[-params.truncate :]
    prompt = check_prompt(ids, backend.info, backend.tokenizer.vocab_size, TGI, "inputs")
    default = backend.info.default_max_new_tokens
    max_new = max_new_tokens(params.max_new_tokens, default, len(prompt), backend.info, TGI, "max_new_tokens")
    stops = stop_sequences(params.stop, backend.info, TGI)
    stopping = StoppingParams(max_new_tokens=max_new, stop_sequences=stops)
    top_n = params.top_n_tokens or 0
    req = generate_request(
        prompt,
        tgi_sampling(params, backend.tokenizer.vocab_size),
        stopping,
        prefill_logprobs=params.decoder_input_details,
        top_n_tokens=top_n,
        # the prompt is already cut; the replica is told no more than it can hold (a 32-bit count)
        truncate=None if params.truncate is None else min(params.truncate, len(prompt)),
        grammar=tgi_grammar(params.grammar),
    )
    ctx = TGIContext(
        details=params.details,
        decoder_input_details=params.decoder_input_details,
        top_n_tokens=top_n,
        prefix=body.inputs if params.return_full_text else "",
        input_length=len(prompt),
    )
    return _Prepared(req, ctx, body.stream, "stream" in body.model_fields_set)


async def _generate(request: Request, prepared: _Prepared, timeline: Timeline, as_list: bool) -> Response:
    timeline.mark_validated()

    def observe(event: Event) -> None:
        if isinstance(event, TokenEvent):
            timeline.mark_token()

    try:
        feed, first = await start(request, prepared.request, TGI)
        observe(first)
        events = await finish_all(request, feed, first, TGI, observe)
    except ClientGone:
        return gone_response()
    finish = events[-1]
    assert isinstance(finish, FinishEvent)  # finish_all guarantees it
    tokens = [e.token for e in events if isinstance(e, TokenEvent)]
    prompt_tokens = next((e.prompt_tokens for e in events if isinstance(e, PrefillEvent)), ())
    body = generate_object(prepared.ctx, finish, tokens, prompt_tokens)
    headers = timeline.headers(
        new_request_id("generate"), finish.prompt_tokens, finish.generated_tokens, len(finish.text)
    )
    headers["x-pdcluster-route"] = dumps(body["pdcluster_route"])
    return json_response([body] if as_list else body, headers=headers)


async def _stream_response(request: Request, prepared: _Prepared) -> Response:
    try:
        feed, first = await start(request, prepared.request, TGI)
    except ClientGone:
        return gone_response()
    return EventStreamResponse(_stream(prepared.ctx, first, feed), feed)


async def _stream(ctx: TGIContext, first: Event, feed: EventFeed) -> AsyncIterator[str]:
    """One event per token; each token is held until the next event so the last one can carry the finish."""
    pending: TokenEvent | None = None
    event: Event | None = first
    try:
        while event is not None:
            if isinstance(event, ErrorEvent):
                yield failed_event(event, TGI)
                return
            if isinstance(event, FinishEvent):
                last = pending or TokenEvent(TokenInfo(id=0, text="", logprob=0.0, special=True), 0)
                yield sse(dumps(stream_object(ctx, last, event)))
                return
            if isinstance(event, TokenEvent):
                if pending is not None:
                    yield sse(dumps(stream_object(ctx, pending)))
                pending = event
            event = await feed.next()
        yield sse(dumps(error_body("the scheduler ended the stream without finishing it", 500, TGI)))
    except APIError as exc:
        yield sse(dumps(exc.body()))
    except Exception as exc:  # a scheduler bug must still end the stream with a reason
        yield sse(dumps(error_body(f"internal error: {exc!r}", 500, TGI)))
