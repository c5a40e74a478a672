"""What every generation route shares: the backend, submitting, waiting for the first event, JSON."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from router.http.errors import APIError, Flavor
from router.http.events import EventFeed, collect, submit, unless_disconnected
from router.http.info import ServingInfo
from router.http.validation import check_model
from router.tokenizer import Tokenizer
from router.types import ErrorEvent, Event, FinishEvent, GenerateRequest, Scheduler

if TYPE_CHECKING:
    from router.http.access import Access

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; never seen by a client


@dataclass(frozen=True)
class Backend:
    """What the routes serve from (kept in `app.state.backend`)."""

    scheduler: Scheduler
    tokenizer: Tokenizer
    info: ServingInfo
    render_metrics: Callable[[], tuple[bytes, str]]
    access: Access | None = None  # API keys and limits; None = open


def backend_of(request: Request) -> Backend:
    """The backend of the model the request chose (`model_backend`), else the app's default one."""
    chosen: Backend | None = getattr(request.state, "backend", None)
    if chosen is not None:
        return chosen
    backend: Backend = request.app.state.backend
    return backend


def backends_of(request: Request) -> Mapping[str, Backend]:
    """Every served model's backend by model id, the default one first."""
    default: Backend = request.app.state.backend
    more: Mapping[str, Backend] = getattr(request.app.state, "backends", {})
    return {default.info.model_id: default, **more}


def model_backend(request: Request, name: str | None, flavor: Flavor = Flavor.OPENAI) -> Backend:
    """The backend of the model a request names (absent: the default one); an unknown model is a
    404 in the route's flavour (OpenAI's `model_not_found`)."""
    backends = backends_of(request)
    default: Backend = request.app.state.backend
    if len(backends) == 1 or name is None:
        check_model(name, default.info, flavor)
        chosen = default
    elif name in backends:
        chosen = backends[name]
    else:
        served = ", ".join(f"`{m}`" for m in backends)
        raise APIError(f"The model `{name}` does not exist; this server serves {served}.", 404, flavor,
                       param="model", code="model_not_found")
    request.state.backend = chosen  # every helper of this request's route serves from it
    return chosen


def new_request_id(prefix: str) -> str:
    """An id like OpenAI's (`cmpl-…`, `chatcmpl-…`)."""
    return f"{prefix}-{uuid.uuid4().hex}"


async def start(request: Request, req: GenerateRequest, flavor: Flavor) -> tuple[EventFeed, Event]:
    """Submit and wait for the first event, so a rejection or an early failure gets a proper HTTP status.

    Raises `ClientGone` when the client leaves while the request waits (the feed is closed). With
    API keys, the request's tokens are charged to its key first (429 or 400 over its tpm).
    """
    backend = backend_of(request)
    lease = backend.access.charge_tokens(request, req, flavor) if backend.access is not None else None
    try:
        feed = submit(backend.scheduler, req, flavor, lease.observe if lease is not None else None)
    except APIError:
        if lease is not None:
            lease.refund()  # never queued: nothing to charge
        raise
    first = await unless_disconnected(feed.next(), request.receive, feed)
    if first is None:
        await feed.close()
        raise APIError("the scheduler ended the request without an answer", 500, flavor)
    if isinstance(first, ErrorEvent):
        # Nothing sent yet: even a streamed request can still get a proper 5xx status.
        await feed.close()
        raise APIError(f"generation failed: {first.message}", max(first.http_status, 500), flavor)
    return feed, first


async def finish_all(
    request: Request,
    feed: EventFeed,
    first: Event,
    flavor: Flavor,
    observe: Callable[[Event], None] | None = None,
) -> list[Event]:
    """All events of a non-streamed request, ending with its `FinishEvent`; errors become `APIError`."""
    try:
        rest = (
            []
            if isinstance(first, FinishEvent | ErrorEvent)
            else await unless_disconnected(collect(feed, observe), request.receive, feed)
        )
    finally:
        await feed.close()
    events = [first, *rest]
    last = events[-1]
    if isinstance(last, ErrorEvent):
        raise APIError(f"generation failed: {last.message}", max(last.http_status, 500), flavor)
    if not isinstance(last, FinishEvent):
        raise APIError("the scheduler ended the request without finishing it", 500, flavor)
    return events


def gone_response() -> Response:
    """What a handler returns after its client disconnected (nobody reads it)."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)
