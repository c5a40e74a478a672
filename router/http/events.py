"""Driving the scheduler's event iterator for one HTTP request, and letting go of it when the client does.

Closing the scheduler's iterator is how the core learns that a client went away (it then drops the
request and frees its pages), so every path closes it exactly once:

    submit ──► EventFeed ──► first event (raced against disconnect) ──► stream body / collect
                  ▲                                                        │
                  └──────── close(): normal end, error, disconnect ◄───────┘

- before the response starts (waiting for the first event, or a whole non-streamed answer), a
  watcher reads the ASGI `receive` channel; an ``http.disconnect`` cancels the wait and closes;
- while streaming, Starlette cancels the body on disconnect and `EventStreamResponse` closes after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from router.http.errors import APIError, Flavor, error_body
from router.types import ErrorEvent, Event, FinishEvent, GenerateRequest, RequestRejected, Scheduler

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class EventFeed:
    """One request's scheduler events; `close()` is idempotent and survives cancellation."""

    def __init__(
        self, events: AsyncIterator[Event], flavor: Flavor, observe: Callable[[Event], None] | None = None
    ) -> None:
        self._events = events
        self._flavor = flavor
        self._observe = observe  # sees every event (an API key's token count)
        self._closed = False
        self._ended = False

    async def next(self) -> Event | None:
        """The next event, or None once the request has finished or failed."""
        if self._ended:
            return None
        try:
            event = await self._events.__anext__()
        except StopAsyncIteration:
            self._ended = True
            return None
        except RequestRejected as exc:
            self._ended = True
            raise APIError(str(exc), exc.http_status, self._flavor) from exc
        if isinstance(event, FinishEvent | ErrorEvent):
            self._ended = True
        if self._observe is not None:
            self._observe(event)
        return event

    async def close(self) -> None:
        """Close the scheduler's iterator (tells the core the client is gone if it had not finished)."""
        if self._closed:
            return
        self._closed = True
        aclose = getattr(self._events, "aclose", None)
        if aclose is None:
            return
        # Shielded: this often runs inside a cancelled scope (client disconnect), where an
        # unshielded await would be cancelled before the core got to free the pages.
        with anyio.CancelScope(shield=True):
            await aclose()


def submit(
    scheduler: Scheduler,
    request: GenerateRequest,
    flavor: Flavor,
    observe: Callable[[Event], None] | None = None,
) -> EventFeed:
    """Hand a request to the scheduler; `RequestRejected` becomes an `APIError` with its status."""
    try:
        return EventFeed(scheduler.submit(request), flavor, observe)
    except RequestRejected as exc:
        raise APIError(str(exc), exc.http_status, flavor) from exc


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], receive: Receive, feed: EventFeed) -> T:
    """Await `work`, but if the client disconnects first: cancel it, close the feed, raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if task.cancelled() or task.exception() is not None:
            await feed.close()
    if task.cancelled():
        raise ClientGone
    return task.result()


async def collect(feed: EventFeed, observe: Callable[[Event], None] | None = None) -> list[Event]:
    """Every event of a request, up to its finish or error; `observe` sees each as it arrives."""
    events: list[Event] = []
    while (event := await feed.next()) is not None:
        if observe is not None:
            observe(event)
        events.append(event)
    return events


class Closable(Protocol):
    """What a stream closes when it ends: one request's `EventFeed`, or the feeds of its samples."""

    async def close(self) -> None: ...


class EventStreamResponse(StreamingResponse):
    """An SSE response that closes the scheduler's iterator however the stream ends."""

    def __init__(self, body: AsyncIterator[str], feed: Closable, headers: dict[str, str] | None = None):
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self._feed = feed
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose: Callable[[], Awaitable[None]] | None = getattr(self._body, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._feed.close()


def sse(data: str) -> str:
    """One server-sent event carrying `data` (a JSON text or ``[DONE]``)."""
    return f"data: {data}\n\n"


def failed_event(event: ErrorEvent, flavor: Flavor) -> str:
    """The SSE error event sent when a request fails mid-stream (the stream then ends)."""
    body = error_body(f"generation failed: {event.message}", max(event.http_status, 500), flavor)
    return sse(json.dumps(body, ensure_ascii=False, separators=(",", ":")))
