"""A Tanz load into replicas laid out for another model runs as a chain (each part started from the
tail, once laid out); into replicas of the model's layout it stays a Tanz."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from router import weights
from router.weights import Method


@dataclass
class _Client:
    calls: list[tuple[str, int]]
    rank: int

    async def tanz_broadcast(self, *_args: Any) -> None:
        self.calls.append(("tanz", self.rank))

    async def rdma_broadcast(self, *_args: Any) -> None:
        self.calls.append(("chain", self.rank))

    async def wait_rdma_done(self) -> None:
        self.calls.append(("wait", self.rank))


@dataclass
class _Member:
    rank: int
    layout: str
    calls: list[tuple[str, int]] = field(default_factory=list)
    alive: bool = True

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    @property
    def client(self) -> _Client:
        return _Client(self.calls, self.rank)


def _run(layouts: tuple[str, str]) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []
    sources = [_Member(0, "big", calls)]
    targets = [_Member(1, layouts[0], calls), _Member(2, layouts[1], calls)]
    members = cast(Sequence[weights.Member], [*sources, *targets])  # fakes of the calls used here
    asyncio.run(weights.move(Method.TANZ, members[:1], members[1:], "big"))
    return calls


def test_tanz_into_replicas_of_the_models_layout_stays_a_tanz() -> None:
    assert sorted(_run(("big", "big"))) == [("tanz", 0), ("tanz", 1), ("tanz", 2)]


def test_tanz_into_a_replica_of_another_layout_runs_as_a_chain_from_its_tail() -> None:
    calls = _run(("big", "small"))
    assert calls[:3] == [("chain", 2), ("chain", 1), ("chain", 0)]
    assert sorted(calls[3:]) == [("wait", 0), ("wait", 1), ("wait", 2)]
