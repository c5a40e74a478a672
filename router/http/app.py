"""The FastAPI application: OpenAI and TGI routes over one `Scheduler`, plus /health and /metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from router.http import openai_api, tgi_api, tokenize_api
from router.http.access import Access, ApiKeyMiddleware
from router.http.common import Backend, backend_of, backends_of
from router.http.errors import APIError, Flavor, error_body
from router.http.info import ServingInfo
from router.http.keys import KeyTable
from router.http.openapi import build_openapi
from router.http.responses import json_response
from router.tokenizer import Tokenizer
from router.types import Scheduler

_TGI_PATHS = ("/generate", "/generate_stream", "/", "/info")


def create_app(
    scheduler: Scheduler,
    tokenizer: Tokenizer,
    info: ServingInfo,
    render_metrics: Callable[[], tuple[bytes, str]],
    api_keys: KeyTable | None = None,
    more_models: Sequence[tuple[Scheduler, Tokenizer, ServingInfo]] = (),
) -> FastAPI:
    """Build the HTTP front end; serve it with uvicorn (`uvicorn.Server(uvicorn.Config(app, ...))`).

    With `api_keys`, every /v1/* and TGI generation route needs `Authorization: Bearer KEY` and
    each key's limits apply (access.py); without, the routes are open. `more_models`: further models
    served beside the default one, chosen by a request's `model` (router/README.md, several models).
    """
    app = FastAPI(title="pdcluster router", version=info.version, docs_url="/docs", redoc_url=None)
    access = Access.from_table(api_keys) if api_keys is not None else None
    app.state.backend = Backend(scheduler, tokenizer, info, render_metrics, access)
    app.state.backends = {i.model_id: Backend(s, t, i, render_metrics, access) for s, t, i in more_models}
    app.include_router(openai_api.router)
    app.include_router(tgi_api.router)
    app.include_router(tokenize_api.router)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    if access is not None:
        app.add_middleware(ApiKeyMiddleware, access=access)
    document = build_openapi(app.title, info, tokenizer.vocab_size, keys=access is not None,
                             more_model_ids=tuple(i.model_id for _, _, i in more_models))
    app.openapi = lambda: document  # type: ignore[method-assign]  # the routes parse bodies themselves
    return app


async def health(request: Request) -> Response:
    """200 when at least one replica can serve, else 503."""
    healthy = any(b.scheduler.is_healthy() for b in backends_of(request).values())
    return json_response({"status": "ok" if healthy else "unavailable"}, 200 if healthy else 503)


async def metrics(request: Request) -> Response:
    """Prometheus text from the scheduler's metrics (and the API keys' when configured)."""
    backend = backend_of(request)
    body, content_type = backend.render_metrics()
    if backend.access is not None:
        body += backend.access.metrics.render()
    return Response(body, media_type=content_type)


def _flavor(request: Request) -> Flavor:
    return Flavor.TGI if request.url.path in _TGI_PATHS else Flavor.OPENAI


async def _api_error(request: Request, exc: APIError) -> Response:
    return json_response(exc.body(), exc.status, exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    return json_response(error_body(f"internal error: {exc!r}", 500, _flavor(request)), 500)
