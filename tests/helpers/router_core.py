"""Helpers for the router core's tests: a scheduler over real in-process replicas (`real_cluster`)
or over fake ones (`fake_cluster`, for injected faults), request builders, page checks.

    async with real_cluster(model, tmp_path, (State.PREFILL, State.DECODE)) as (sched, replicas):
        events = await collect(sched.submit(request([5, 6, 7], 8)))
        assert tokens_of(events) == greedy(model)([5, 6, 7], 8)
        await pages_back(replicas)

Both kinds of replica expose `calls` (the RPCs the router sent, in order) and `pages()` (total and
free KV pages); a real replica's calls are recorded at the router's client (`RecordingClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from protos import generate_pb2 as pb
from router.client import ReplicaClient
from router.config import RouterConfig, Strategy
from router.main import kv_bytes_per_token
from router.replica_api import Connect, ReplicaApi
from router.replicas import State
from router.requests import now
from router.scheduler import ClusterScheduler
from router.tokenizer import Tokenizer
from router.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateRequest,
    SamplingParams,
    StoppingParams,
    TokenDecoder,
    TokenEvent,
)
from tests.helpers.engine_driver import reference_greedy
from tests.helpers.eventually import eventually_async
from tests.helpers.fake_replica import FakeFabric, FakeReplica
from tests.helpers.inproc_cluster import CALL_TIMEOUT, InProcReplica, inproc_cluster
from tests.helpers.recording_client import recording_connect


def run(coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
    """Run an async test body with a deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def request(prompt: Sequence[int], max_new: int = 8, ignore_eos: bool = False) -> GenerateRequest:
    """A greedy request."""
    return GenerateRequest(tuple(prompt), SamplingParams(), StoppingParams(max_new, ignore_eos=ignore_eos))


async def collect(stream: AsyncIterator[Event]) -> list[Event]:
    """Every event of a request."""
    return [e async for e in stream]


def tokens_of(events: list[Event]) -> list[int]:
    """Generated token ids."""
    return [e.token.id for e in events if isinstance(e, TokenEvent)]


def finish_of(events: list[Event]) -> FinishEvent:
    """The last event, which must be a FinishEvent."""
    last = events[-1]
    assert isinstance(last, FinishEvent), last
    return last


def error_of(events: list[Event]) -> ErrorEvent:
    """The last event, which must be an ErrorEvent."""
    last = events[-1]
    assert isinstance(last, ErrorEvent), last
    return last


class FakeDecoder:
    """The fake replica's detokenizer: token id i prints "<i>" (tests/helpers/fake_replica.py)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`."""
        return "".join(f"<{i}>" for i in ids)


def scheduler(cfg: RouterConfig, kv_bytes_per_token: int = 0, clock: Callable[[], float] = now,
              decoder: TokenDecoder | None = None, connect: Connect | None = None) -> ClusterScheduler:
    """A scheduler over gRPC clients of replicas (by default with the fake replica's detokenizer)."""
    def plain(address: str) -> ReplicaApi:
        return ReplicaClient(address, cfg.rpc_timeout, cfg.transfer_timeout)

    return ClusterScheduler(cfg, decoder or FakeDecoder(), connect or plain,
                            kv_bytes_per_token=kv_bytes_per_token, clock=clock)


def config(strategy: Strategy | str = Strategy.FULL, **overrides: Any) -> RouterConfig:
    """A router config for in-process tests (fast liveness checks)."""
    values: dict[str, Any] = {"model": Path("."), "strategy": strategy, "heartbeat_interval": 0.1,
                              "heartbeat_timeout": 0.5, "rpc_timeout": 10.0, "transfer_timeout": 10.0}
    values.update(overrides)
    return RouterConfig(**values)


@contextlib.asynccontextmanager
async def fake_cluster(roles: Sequence[State], strategy: Strategy | str = Strategy.FULL,
                       kv_bytes_per_token: int = 8, num_blocks: int = 256, **overrides: Any
                       ) -> AsyncIterator[tuple[ClusterScheduler, list[FakeReplica]]]:
    """Fake replicas (ranks 0..n-1) with the given roles behind a started scheduler; an inactive
    one has no weights."""
    fabric = FakeFabric()
    fakes = [FakeReplica(rank, fabric, num_blocks=num_blocks, loaded=role is not State.INACTIVE)
             for rank, role in enumerate(roles)]
    sched = scheduler(config(strategy, **overrides), kv_bytes_per_token)
    try:
        for fake, role in zip(fakes, roles, strict=True):
            await sched.add_replica(await fake.start(), role)
        await sched.start()
        yield sched, fakes
    finally:
        await sched.stop()
        for fake in fakes:
            await fake.stop()


@dataclass
class RealReplica:
    """A real replica in this process, as the router core's tests see it."""

    replica: InProcReplica
    calls: list[str]  # the RPCs the router sent it, in order (recorded at the router's client)

    @property
    def address(self) -> str:
        """host:port of its gRPC service."""
        return f"127.0.0.1:{self.replica.services.port}"

    async def pages(self) -> tuple[int, int]:
        """(total, free) KV pages, from Info."""
        info = await asyncio.to_thread(self.replica.stub.Info, pb.InfoRequest(), timeout=CALL_TIMEOUT)
        return info.num_blocks_total, info.num_blocks_free


@contextlib.asynccontextmanager
async def real_cluster(model: Path, tmp_path: Path, roles: Sequence[State],
                       strategy: Strategy | str = Strategy.FULL, num_blocks: int = 64, spare: int = 0,
                       **overrides: Any
                       ) -> AsyncIterator[tuple[ClusterScheduler, list[RealReplica]]]:
    """Real replicas of `model` in this process (ranks 0..n-1, one rank table; an inactive one
    starts with no weights) with the given roles behind a started scheduler that decodes text with
    the model's tokenizer and records every replica's calls. `spare` more replicas (loaded) are
    started but not added: the test joins them."""
    def config_for(rank: int) -> dict[str, Any]:
        return {"num_blocks": num_blocks, "inactive": rank < len(roles) and roles[rank] is State.INACTIVE}

    cfg = config(strategy, model=model, **overrides)
    calls: dict[str, list[str]] = {}
    sched = scheduler(cfg, kv_bytes_per_token(model, "float32"), decoder=Tokenizer.from_model_dir(model),
                      connect=recording_connect(cfg, calls))
    with inproc_cluster(model, tmp_path, len(roles) + spare, config_for) as replicas:
        reals = [RealReplica(r, calls.setdefault(f"127.0.0.1:{r.services.port}", [])) for r in replicas]
        try:
            for real, role in zip(reals, roles, strict=False):  # spares stay out
                await sched.add_replica(real.address, role)
            await sched.start()
            yield sched, reals
        finally:
            await sched.stop()


class HasPages(Protocol):
    """A fake or a real replica."""

    async def pages(self) -> tuple[int, int]:
        """(total, free) KV pages."""
        ...


async def pages_back(replicas: Sequence[HasPages], timeout: float = 10.0) -> None:
    """Wait until every replica has all its pages free (the replica frees some after answering)."""
    async def all_free() -> bool:
        return all(total == free for total, free in [await r.pages() for r in replicas])

    await eventually_async(all_free, timeout, message="every page back")


@functools.cache
def greedy(model: Path) -> Callable[..., list[int]]:
    """transformers' greedy tokens of a prompt on `model` (stopping at EOS like the replica, unless
    `ignore_eos`): `greedy(model)(prompt, max_new, ignore_eos=False)`."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()

    @functools.cache
    def tokens(prompt: tuple[int, ...], max_new: int, ignore_eos: bool) -> list[int]:
        with torch.no_grad():
            return reference_greedy(hf, prompt, max_new, ignore_eos)[0]

    return lambda prompt, max_new, ignore_eos=False: tokens(tuple(prompt), max_new, ignore_eos)
