"""Helpers for the router core's tests: a scheduler over fake replicas, request builders."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from router.client import ReplicaClient
from router.config import RouterConfig, Strategy
from router.replica_api import ReplicaApi
from router.replicas import State
from router.requests import now
from router.scheduler import ClusterScheduler
from router.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateRequest,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)
from tests.helpers.fake_replica import FakeFabric, FakeReplica


def run(coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
    """Run an async test body with a deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def request(prompt: Sequence[int], max_new: int = 8) -> GenerateRequest:
    """A greedy request."""
    return GenerateRequest(tuple(prompt), SamplingParams(), StoppingParams(max_new))


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


def scheduler(cfg: RouterConfig, kv_bytes_per_token: int = 0, clock: Callable[[], float] = now
              ) -> ClusterScheduler:
    """A scheduler over gRPC clients of (fake) replicas, with the fake replica's detokenizer."""
    def connect(address: str) -> ReplicaApi:
        return ReplicaClient(address, cfg.rpc_timeout, cfg.transfer_timeout)

    return ClusterScheduler(cfg, FakeDecoder(), connect, kv_bytes_per_token=kv_bytes_per_token, clock=clock)


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
    """Fake replicas (ranks 0..n-1) with the given roles behind a started scheduler."""
    fabric = FakeFabric()
    fakes = [FakeReplica(rank, fabric, num_blocks=num_blocks) for rank in range(len(roles))]
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
