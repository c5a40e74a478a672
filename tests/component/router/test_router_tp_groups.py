"""The router's view of tensor-parallel groups, over fake tp2 replicas: a group is one replica whose
global ranks are `rank` .. `rank + tp - 1`; Migrate/Immigrate name one rank per tp_rank on each side
(full and progressive), a chain or Tanz multicast into two inactive groups names every rank of every
group (groups contiguous), a decode group is preferred over one of another size, and ListReplicas and
/metrics show the group's size."""

from __future__ import annotations

import pytest

from router import control
from router.admin import replica_status
from router.config import Strategy
from router.replicas import State
from router.weights import Method
from tests.helpers.eventually import eventually_async
from tests.helpers.fake_replica import FakeFabric, FakeReplica, expected_tokens
from tests.helpers.router_core import collect, config, request, run, scheduler, tokens_of


@pytest.mark.parametrize("strategy", [Strategy.FULL, Strategy.PROGRESSIVE])
def test_kv_moves_name_one_rank_per_tp_rank(strategy: Strategy) -> None:
    async def body() -> None:
        fabric = FakeFabric()
        fakes = [FakeReplica(0, fabric, tp=2), FakeReplica(2, fabric, tp=1), FakeReplica(3, fabric, tp=2)]
        sched = scheduler(config(strategy))
        try:
            for fake, role in zip(fakes, (State.PREFILL, State.DECODE, State.DECODE), strict=True):
                await sched.add_replica(await fake.start(), role)
            await sched.start()
            events = await collect(sched.submit(request([4, 2, 7], 5)))
            assert tokens_of(events) == expected_tokens([4, 2, 7], 5)
            moves = [("Immigrate", (0, 1), (3, 4))]
            assert fakes[2].rank_lists == moves and fakes[1].rank_lists == []  # the tp2 decode group
            if strategy is Strategy.FULL:
                assert fakes[0].rank_lists == [("Migrate", (0, 1), (3, 4))]
            status = [replica_status(sched, h) for h in sched.replicas.values()]
            assert [(s.rank, s.tp_size, list(s.ranks)) for s in status] == [(0, 2, [0, 1]), (2, 1, [2]),
                                                                           (3, 2, [3, 4])]
            sched.metrics.update_replicas(h.state for h in sched.replicas.values())
            text = sched.metrics.render()[0].decode()
            assert 'pdcluster_replica_tp_size{replica="0"} 2.0' in text
            assert 'pdcluster_replica_tp_size{replica="1"} 1.0' in text
        finally:
            await sched.stop()
            for f in fakes:
                await f.stop()
    run(body(), timeout=30)


@pytest.mark.parametrize(("method", "sources"), [(Method.CHAIN, 1), (Method.TANZ, 2)])
def test_multicast_into_two_groups_names_every_rank(method: Method, sources: int) -> None:
    async def body() -> None:
        fabric = FakeFabric()
        fakes = [FakeReplica(2 * i, fabric, tp=2, loaded=i < sources) for i in range(sources + 2)]
        roles = [State.DECODE] * sources + [State.INACTIVE] * 2
        sched = scheduler(config(Strategy.FULL))
        try:
            for fake, role in zip(fakes, roles, strict=True):
                await sched.add_replica(await fake.start(), role)
            await sched.start()
            ids = [h.id for h in sched.replicas.values()]
            await control.activate(sched, ids[sources:], State.DECODE, method, ids[:sources])
            # chain: tp_rank t's chain is [src_ranks[t]] + dst_ranks[t::2] = (0, 2, 4) and (1, 3, 5)
            src = tuple(range(2 * sources))
            call = "RdmaBroadcast" if method is Method.CHAIN else "TanzBroadcast"
            assert {f.rank_lists[0] for f in fakes} == {(call, src, tuple(range(len(src), len(src) + 4)))}
            assert all(sched.replicas[i].state.role in (State.PREFILL, State.DECODE) for i in ids)
        finally:
            await sched.stop()
            for f in fakes:
                await f.stop()
    run(body(), timeout=30)


def test_a_broken_group_is_dead_and_stays_dead_though_it_answers_info() -> None:
    async def body() -> None:
        fabric = FakeFabric()
        fakes = [FakeReplica(0, fabric, tp=2), FakeReplica(2, fabric, tp=2)]
        fakes[1].broken = True  # its worker rank died: Immigrate fails UNAVAILABLE
        sched = scheduler(config(Strategy.FULL))
        try:
            for fake, role in zip(fakes, (State.PREFILL, State.DECODE), strict=True):
                await sched.add_replica(await fake.start(), role)
            await sched.start()
            events = await collect(sched.submit(request([4, 2, 7], 5)))
            assert tokens_of(events) == expected_tokens([4, 2, 7], 5)  # re-run, decoded on replica 0
            dead = list(sched.replicas.values())[1]
            assert not dead.state.alive
            polls = fakes[1].calls.count("Info")
            await eventually_async(lambda: fakes[1].calls.count("Info") >= polls + 3)  # polled, Info answers
            assert not dead.state.alive and "Health" in fakes[1].calls  # asked, and it stays dead
        finally:
            await sched.stop()
            for f in fakes:
                await f.stop()
    run(body(), timeout=30)
