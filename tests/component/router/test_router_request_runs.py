"""A request's runs: continuations keep the token allowance, the pages and seeded sampling (the
replica continues the step index from `generated_prefix`: tests/component/engine)."""

from __future__ import annotations

import asyncio

from router.queue import request_blocks
from router.requests import RequestState
from router.types import (
    Finished,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    Generation,
    RequestId,
    SamplingParams,
    StoppingParams,
    TokenInfo,
)
from tests.helpers.router_core import FakeDecoder


def state(max_new: int = 10, seed: int | None = 7, do_sample: bool = True) -> RequestState:
    req = GenerateRequest((1, 2, 3), SamplingParams(do_sample=do_sample, seed=seed), StoppingParams(max_new))
    return RequestState(RequestId(1), req, lambda: 0.0, FakeDecoder())


def token(i: int) -> Generation:
    return Generation(RequestId(1), (TokenInfo(i, f"<{i}>", 0.0),))


def test_continuation_keeps_allowance_and_pages_and_reports_the_client_seed() -> None:
    async def body() -> None:
        st = state()
        pages = request_blocks(st.current(), 16)
        for i in (11, 12, 13):
            st.deliver(token(i))
        st.new_run()
        cont = st.current()
        assert cont.input_ids == (1, 2, 3, 11, 12, 13)
        assert cont.generated_prefix == 3  # the replica counts them as generated
        assert cont.sampling == st.original.sampling  # same seed: the replica continues its step index
        assert cont.stopping.max_new_tokens == 7
        assert request_blocks(cont, 16) == pages
        st.deliver(Generation(RequestId(1), (TokenInfo(14, "<14>", 0.0),),
                              finished=Finished("<14>", 1, FinishReason.LENGTH, seed=cont.sampling.seed)))
        events = [st.events.get_nowait() for _ in range(st.events.qsize())]
        fin = events[-1]
        assert isinstance(fin, FinishEvent)
        assert fin.text == "<11><12><13><14>" and fin.generated_tokens == 4 and fin.seed == 7
    asyncio.run(body())


def test_the_route_counts_the_re_runs_after_replica_failures() -> None:
    """The experiment harness reports each request's retries from its route."""
    async def body() -> None:
        st = state()
        st.deliver(token(11))
        st.requeues += 1  # what the scheduler does when the request's replica died
        st.new_run()
        st.deliver(Generation(RequestId(1), (TokenInfo(12, "<12>", 0.0),),
                              finished=Finished("<12>", 1, FinishReason.LENGTH)))
        events = [st.events.get_nowait() for _ in range(st.events.qsize())]
        assert isinstance(events[-1], FinishEvent) and events[-1].route.requeues == 1
    asyncio.run(body())
