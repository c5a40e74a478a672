"""The `bench serving` load generator's HTTP client: streamed completions, timed per SSE event, lean.

```
 stream_completion(url, body, record) ── TCP connect ── POST (HTTP/1.1) ──► router
        ▲                                                                    │ chunked SSE
        └── StreamTimer (per `data:` event) ◄── httptools parser ◄── data_received(packet) ◄┘
```

The load generator shares the machine's cores with the cluster it measures: every cycle it spends
per token is taken from the router and the replicas. So each stream is an `asyncio.Protocol` over
httptools' C parser (the one uvicorn uses): a received packet is parsed in one callback, with no
task wake-up and no line-by-line iteration per token. Every SSE event is timed at the arrival of
the packet that carried it, which is what a line reader sees, minus its scheduling delay.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.request
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from pdcluster.bench.serving.stats import RequestRecord


def get_json(url: str, timeout: float = 30.0) -> Any:
    """GET `url` and parse its JSON answer (setup calls only; blocking)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


# A chunk of one streamed token, as the router writes it (compact JSON): its only unfinished choice.
# Inside a JSON string the quotes would be escaped, so generated text cannot fake it; any other
# server's chunks (other spacing) are parsed in full.
_TOKEN_MARK = b'"finish_reason":null}]'


class StreamTimer:
    """Folds one response's SSE `data:` payloads into a `RequestRecord` (times from `sent`)."""

    def __init__(self, record: RequestRecord, sent: float) -> None:
        self.record = record
        self.sent = sent
        self.last = sent
        self.tokens = 0
        self.ended = False

    def event(self, data: bytes, now: float) -> None:
        """One `data:` payload received at `now`: a token chunk, the finish, usage, an error or [DONE]."""
        if self.ended:
            return
        if data == b"[DONE]":
            self.end(now)
            return
        if _TOKEN_MARK in data:  # a token chunk (pdcluster's compact JSON): timed without parsing it
            self.token(now)
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self.record.error = str(chunk["error"])
            self.ended = True
            return
        if chunk.get("choices"):
            choice = chunk["choices"][0]
            if choice.get("finish_reason") is None:
                self.token(now)
            else:  # vLLM's last token comes in the chunk with the finish reason; pdcluster's does not
                for _ in range(_tokens_in(choice)):
                    self.token(now)
            self.record.route = chunk.get("pdcluster_route", self.record.route)
        if chunk.get("usage"):
            self.record.output_len = int(chunk["usage"]["completion_tokens"])

    def token(self, now: float) -> None:
        """One streamed token arrived at `now`."""
        self.tokens += 1
        if self.tokens == 1:
            self.record.ttft = now - self.sent
        else:
            self.record.itl.append(now - self.last)
        self.last = now

    def end(self, now: float) -> None:
        """The stream is over (its [DONE], or the body ended without one)."""
        if self.ended:
            return
        self.ended = True
        record = self.record
        record.latency = now - self.sent
        record.output_len = record.output_len or self.tokens
        record.success = self.tokens > 0
        if not record.success:
            record.error = "the stream carried no token"


def _tokens_in(choice: dict[str, Any]) -> int:
    """Tokens a streamed choice carries: its logprobs' tokens, else one if it has text."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return 1 if choice.get("text") or (choice.get("delta") or {}).get("content") else 0


class _StreamProtocol(asyncio.Protocol):
    """One POST on its own connection; the SSE body goes to a `StreamTimer` as packets arrive."""

    def __init__(self, request: bytes, timer: StreamTimer, done: asyncio.Future[None]) -> None:
        self.request = request
        self.timer = timer
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.pending = b""  # SSE text not yet ended by a blank line
        self.error_body = b""
        self.now = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.WriteTransport, transport).write(self.request)  # uvloop's is no asyncio subclass

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # a malformed answer fails this request only
            self._finish(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(ConnectionError(f"connection closed before the answer ended ({exc})"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body += body
            return
        self.pending += body
        while (end := self.pending.find(b"\n\n")) >= 0:
            event, self.pending = self.pending[:end], self.pending[end + 2 :]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self.timer.event(line[5:].strip(), self.now)

    def on_message_complete(self) -> None:
        if self.status != 200:
            self.timer.record.error = f"HTTP {self.status}: {self.error_body[:300].decode(errors='replace')}"
        elif not self.timer.record.error:
            self.timer.end(self.now)
        self._finish(None)

    def _finish(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if exc is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(exc)


async def stream_completion(url: str, body: dict[str, Any], record: RequestRecord) -> None:
    """POST a streamed `/v1/completions` to the router at `url` and time every token into `record`."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    payload = json.dumps(body).encode()
    request = (
        f"POST {parts.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    sent = time.perf_counter()
    timer = StreamTimer(record, sent)
    context = ssl.create_default_context() if parts.scheme == "https" else None
    transport, _ = await loop.create_connection(
        lambda: _StreamProtocol(request, timer, done), host, port, ssl=context
    )
    try:
        await done
    finally:
        transport.close()
