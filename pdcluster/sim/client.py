"""The load generator of a virtual-time run: each request submitted at its arrival, timed per token.

It measures what `bench serving`'s client measures over HTTP (`RequestRecord`: TTFT = first token
− send, every inter-token gap, E2EL, output tokens, the route), but at the router's scheduler
itself (`Scheduler.submit`), on the virtual clock: HTTP and the network to the client cost nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence

from pdcluster.bench.serving.stats import RequestRecord
from pdcluster.bench.serving.workload import Arrival
from router.types import (
    ErrorEvent,
    FinishEvent,
    GenerateRequest,
    RequestRejected,
    SamplingParams,
    Scheduler,
    StoppingParams,
    TokenEvent,
)


async def send_all(scheduler: Scheduler, arrivals: Sequence[Arrival], prompts: Sequence[list[int]],
                   timeout: float, progress: Callable[[int], None] | None = None,
                   models: Mapping[str, Scheduler] | None = None) -> tuple[list[RequestRecord], float]:
    """Every request at its arrival (seconds from now); (records, seconds to the last answer).

    One sender sleeps from arrival to arrival and starts each request's task then: the loop's timer
    heap holds the requests in flight, not every request of the run. With `models`, a request that
    names a model (`Arrival.model`) goes to that model's scheduler."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    done = [0]

    async def one(index: int) -> RequestRecord:
        arrival = arrivals[index]
        target = models[arrival.model] if models and arrival.model else scheduler
        record = await _one(target, index, arrival, prompts[index], t0, timeout)
        done[0] += 1
        if progress is not None:
            progress(done[0])
        return record

    tasks: dict[int, asyncio.Task[RequestRecord]] = {}
    for index in sorted(range(len(arrivals)), key=lambda i: arrivals[i].at):
        delay = t0 + arrivals[index].at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks[index] = loop.create_task(one(index))
    records = await asyncio.gather(*(tasks[i] for i in range(len(arrivals))))
    return list(records), loop.time() - t0


async def _one(scheduler: Scheduler, index: int, arrival: Arrival, prompt: list[int], t0: float,
               timeout: float) -> RequestRecord:
    loop = asyncio.get_running_loop()
    sent = loop.time()
    record = RequestRecord(index=index, input_len=arrival.input_len, scheduled=arrival.at, start=sent - t0)
    stopping = StoppingParams(arrival.output_len, ignore_eos=True)
    request = GenerateRequest(tuple(prompt), SamplingParams(), stopping)
    try:
        async with asyncio.timeout(timeout):
            await _stream(scheduler, request, record, sent)
    except TimeoutError:
        record.success, record.error = False, f"no answer within {timeout} s"
    except RequestRejected as exc:
        record.error = f"HTTP {exc.http_status}: {exc}"
    return record


async def _stream(scheduler: Scheduler, request: GenerateRequest, record: RequestRecord, sent: float) -> None:
    loop = asyncio.get_running_loop()
    last, tokens = sent, 0
    stream = scheduler.submit(request)
    try:
        async for event in stream:
            now = loop.time()
            if isinstance(event, TokenEvent):
                tokens += 1
                if tokens == 1:
                    record.ttft = now - sent
                else:
                    record.itl.append(now - last)
                last = now
            elif isinstance(event, FinishEvent):
                route = event.route  # flat: its fields as they are (asdict would copy each deeply)
                record.route = {f.name: getattr(route, f.name) for f in dataclasses.fields(route)}
                record.output_len = event.generated_tokens or tokens
                record.success = tokens > 0
            elif isinstance(event, ErrorEvent):
                record.error = event.message
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    record.latency = loop.time() - sent
    if not record.success and not record.error:
        record.error = "the stream carried no token"
