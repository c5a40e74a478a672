"""Fault handling of the scheduling core over fake replicas (the faults only a fake can inject on
cue): replica errors, replicas that stop or blame their peer, missed heartbeats on a fake clock,
failed weight transfers, pages a replica frees late. The same scenarios without faults run over
real replicas (test_router_core_real_replicas.py, test_router_control_real_replicas.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router import control
from router.config import Strategy
from router.errors import ReplicaCallError, ReplicaRejected
from router.replicas import State
from router.types import ErrorEvent, ReplicaId
from router.weights import Method
from tests.helpers.eventually import eventually_async
from tests.helpers.fake_replica import FakeFabric, FakeReplica, expected_tokens
from tests.helpers.router_core import (
    collect,
    config,
    error_of,
    fake_cluster,
    finish_of,
    pages_back,
    request,
    run,
    scheduler,
    tokens_of,
)

PD = (State.PREFILL, State.DECODE)
ONE_AND_TWO_INACTIVE = (State.COLOCATED, State.INACTIVE, State.INACTIVE)


def test_replica_error_fails_only_that_batch_and_the_router_keeps_serving() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, fakes):
            fakes[1].fail["DecodeV2"] = grpc.StatusCode.INTERNAL
            failed = await collect(sched.submit(request([7, 7], 5)))
            err = error_of(failed)
            assert "INTERNAL" in err.message and err.http_status >= 500
            ok = await collect(sched.submit(request([7, 7], 5)))
            assert tokens_of(ok) == expected_tokens([7, 7], 5)
            await pages_back(fakes)
    run(body())


def test_decode_replica_dying_mid_run_its_requests_complete_on_the_other() -> None:
    async def body() -> None:
        async with fake_cluster((State.PREFILL, State.DECODE, State.DECODE), Strategy.FULL) as (sched, fakes):
            for f in fakes[1:]:
                f.step_delay = 0.01
            prompts = [[10 + i, 2 * i + 1] for i in range(8)]
            tasks = [asyncio.create_task(collect(sched.submit(request(p, 40)))) for p in prompts]
            await eventually_async(lambda: fakes[1].calls.count("DecodeV2") >= 5)
            await fakes[1].stop()
            results = await asyncio.gather(*tasks)
            for p, events in zip(prompts, results, strict=True):
                assert tokens_of(events) == expected_tokens(p, 40)
                assert finish_of(events).route.decode_replica == 2
            assert sched.replicas[ReplicaId(1)].state.role is State.DEAD
            await pages_back([fakes[0], fakes[2]])
    run(body())


def test_a_migration_whose_replicas_blame_each_other_marks_neither_dead_and_runs_again() -> None:
    # both replicas answer UNAVAILABLE with `x-pdcluster-cause: peer`: they are alive (a stale
    # connection, a peer that came and went); the batch runs again and completes
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, fakes):
            fakes[0].peer_fail.add("Migrate")
            fakes[1].peer_fail.add("Immigrate")
            events = await collect(sched.submit(request([5, 6, 7], 6)))
            assert tokens_of(events) == expected_tokens([5, 6, 7], 6)
            assert [sched.replicas[ReplicaId(i)].state.role for i in (0, 1)] == list(PD)
            assert fakes[0].calls.count("Migrate") == 2
            await pages_back(fakes)
    run(body())


def test_the_side_of_a_failed_migration_that_was_not_reached_is_marked_dead_not_the_other() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL) as (sched, fakes):
            fakes[0].peer_fail.add("Migrate")  # the sender answers: its peer went away
            fakes[1].fail["Immigrate"] = grpc.StatusCode.UNAVAILABLE  # no cause: as if unreachable
            events = await collect(sched.submit(request([9, 8], 5)))
            assert tokens_of(events) == expected_tokens([9, 8], 5)  # re-run without the dead one
            roles = [sched.replicas[ReplicaId(i)].state.role for i in (0, 1)]
            assert roles[1] is State.DEAD and roles[0] is not State.DEAD
    run(body())


def test_a_gone_sender_cancels_the_receivers_wait_and_the_batch_runs_again() -> None:
    # Migrate fails UNAVAILABLE without a cause (the prefill replica is unreachable): no header will
    # ever reach the receiver, so its Immigrate is cancelled rather than left to its deadline
    async def body() -> None:
        async with fake_cluster((State.PREFILL, State.DECODE, State.DECODE), Strategy.FULL) as (sched, fakes):
            fakes[0].fail["Migrate"] = grpc.StatusCode.UNAVAILABLE
            events = await asyncio.wait_for(collect(sched.submit(request([6, 2], 5))), 8)
            assert tokens_of(events) == expected_tokens([6, 2], 5)
            assert sched.replicas[ReplicaId(0)].state.role is State.DEAD
            # the server learns of the cancel a little later; the batch's re-run may have gone to the
            # other decode replica, so the cancelled receiver is whichever one saw it
            await eventually_async(lambda: any("Immigrate" in f.cancelled for f in fakes[1:]))
            await pages_back(fakes[1:])
    run(body())


@pytest.mark.parametrize(("strategy", "sending_call"), [(Strategy.FULL, "Migrate"),
                                                     (Strategy.PROGRESSIVE, "PrefillV2")])
def test_a_gone_receiver_cancels_the_senders_wait_and_the_batch_runs_again(
    strategy: Strategy, sending_call: str
) -> None:
    # Immigrate fails UNAVAILABLE without a cause (the decode replica is unreachable: restarted on its
    # address, say, its fabric up but its gRPC channel not yet): the sender, waiting for an answer no
    # receiver will give, is cancelled rather than left to its deadline (the batch's requests with it)
    async def body() -> None:
        async with fake_cluster((State.PREFILL, State.DECODE, State.DECODE), strategy) as (sched, fakes):
            fakes[0].migrate_waits = True
            fakes[1].fail["Immigrate"] = grpc.StatusCode.UNAVAILABLE
            fakes[2].fail["Immigrate"] = grpc.StatusCode.UNAVAILABLE
            events = await asyncio.wait_for(collect(sched.submit(request([6, 3], 5))), 8)
            assert tokens_of(events) == expected_tokens([6, 3], 5)  # decoded by the prefill replica
            assert [sched.replicas[ReplicaId(i)].state.role for i in (1, 2)] == [State.DEAD] * 2
            await eventually_async(lambda: sending_call in fakes[0].cancelled)
            await pages_back(fakes[:1])
    run(body())


def test_when_every_replica_died_running_and_queued_requests_fail_with_503_instead_of_waiting() -> None:
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL, max_batch_size=1) as (sched, fakes):
            fakes[1].step_delay = 0.02
            tasks = [asyncio.create_task(collect(sched.submit(request([4, i], 100)))) for i in range(3)]
            await eventually_async(lambda: fakes[1].calls.count("DecodeV2") >= 3)
            for fake in fakes:
                await fake.stop()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            for events in results:
                assert error_of(events).http_status == 503
            assert all(sched.replicas[ReplicaId(i)].state.role is State.DEAD for i in (0, 1))
            assert not sched.requests and len(sched.queue) == 0
    run(body())


def test_a_polled_replica_that_answers_again_comes_back_with_its_role_and_nothing_left_on_it() -> None:
    async def body() -> None:
        async with fake_cluster((State.PREFILL, State.DECODE, State.DECODE), Strategy.FULL) as (sched, fakes):
            dead = fakes[2]
            port = int(dead.address.rsplit(":", 1)[1])
            await dead.stop()
            await sched.check_liveness()  # its Info fails: past its deadline it is dead
            await eventually_async(lambda: sched.replicas[ReplicaId(2)].state.role is State.DEAD)
            dead.batches[999] = []  # something the router no longer knows about
            await dead.start(port)  # restarted on its address
            await eventually_async(lambda: sched.replicas[ReplicaId(2)].state.role is State.DECODE)
            # cleared at the join and at the revival
            assert 999 not in dead.batches and dead.calls.count("ClearCache") == 2
            await fakes[1].stop()  # the other decode replica goes: the batch must decode on the revived one
            sched.mark_dead(ReplicaId(1), "stopped by the test")
            events = await collect(sched.submit(request([3, 3], 4)))
            assert tokens_of(events) == expected_tokens([3, 3], 4)
            assert finish_of(events).route.decode_replica == 2
    run(body())


def test_a_replica_activated_by_the_router_restarted_without_weights_gets_its_role_back() -> None:
    async def body() -> None:
        roles = (State.PREFILL, State.DECODE, State.INACTIVE)
        async with fake_cluster(roles, Strategy.FULL) as (sched, fakes):
            await control.activate(sched, [2], State.DECODE, None)  # as the autoscaler would
            restarted = fakes[2]
            port = int(restarted.address.rsplit(":", 1)[1])
            await restarted.stop()
            sched.mark_dead(ReplicaId(2), "stopped by the test")
            restarted.loaded = False  # the supervisor starts it again as the inactive replica it was
            await restarted.start(port)
            await sched.check_liveness()
            await eventually_async(lambda: sched.replicas[ReplicaId(2)].state.role is State.DECODE)
            assert restarted.loaded and sched.replicas[ReplicaId(2)].state.lost_role is State.DECODE
            await fakes[1].stop()  # the batch must decode on the restarted one
            sched.mark_dead(ReplicaId(1), "stopped by the test")
            events = await collect(sched.submit(request([3, 3], 4)))
            assert tokens_of(events) == expected_tokens([3, 3], 4)
            assert finish_of(events).route.decode_replica == 2
    run(body())


def test_a_replica_restarted_within_its_heartbeat_deadline_is_seen_by_its_lost_weights() -> None:
    async def body() -> None:
        roles = (State.PREFILL, State.DECODE, State.INACTIVE)
        async with fake_cluster(roles, Strategy.FULL) as (sched, fakes):
            await control.activate(sched, [2], State.DECODE, None)  # as the autoscaler would
            restarted = fakes[2]
            port = int(restarted.address.rsplit(":", 1)[1])
            await restarted.stop()
            restarted.loaded = False  # back before any poll failed: only its Info says it restarted
            await restarted.start(port)
            await sched.check_liveness()
            await eventually_async(lambda: sched.replicas[ReplicaId(2)].state.role is State.DECODE
                                   and restarted.loaded)
            assert sched.replicas[ReplicaId(2)].state.lost_role is State.DECODE
            await fakes[1].stop()  # the batch must decode on the restarted one
            sched.mark_dead(ReplicaId(1), "stopped by the test")
            events = await collect(sched.submit(request([3, 3], 4)))
            assert tokens_of(events) == expected_tokens([3, 3], 4)
            assert finish_of(events).route.decode_replica == 2
    run(body())


def test_a_new_process_on_a_replicas_address_within_its_deadline_is_taken_back_as_a_new_member() -> None:
    # restarted with its weights (a launcher gives it the model at start) before any poll failed: only
    # Info's process id tells; the router frees what the old process held, connects it again, and
    # the replica decodes the next batch (no heartbeat deadline passes: the test polls by hand)
    async def body() -> None:
        roles = (State.PREFILL, State.DECODE, State.DECODE)
        quiet = {"heartbeat_interval": 60, "heartbeat_timeout": 120}
        async with fake_cluster(roles, Strategy.FULL, **quiet) as (sched, fakes):
            restarted = fakes[2]
            port = int(restarted.address.rsplit(":", 1)[1])
            await restarted.stop()
            restarted.instance = "fake-2-restarted"
            connects, clears = restarted.calls.count("ConnectPeers"), restarted.calls.count("ClearCache")
            await restarted.start(port)

            async def taken_back() -> bool:
                await sched.check_liveness()  # a poll (the first ones may meet the channel reconnecting)
                return restarted.calls.count("ConnectPeers") > connects

            await eventually_async(taken_back, 5, 0.05)
            assert sched.replicas[ReplicaId(2)].state.role is State.DECODE
            assert restarted.calls.count("ClearCache") == clears + 1
            await fakes[1].stop()
            sched.mark_dead(ReplicaId(1), "stopped by the test")
            events = await collect(sched.submit(request([3, 4], 4)))
            assert tokens_of(events) == expected_tokens([3, 4], 4)
            assert finish_of(events).route.decode_replica == 2
            await sched.check_liveness()  # the same process again: nothing happens
            assert sched.replicas[ReplicaId(2)].state.role is State.DECODE
            assert restarted.calls.count("ClearCache") == clears + 1
    run(body())


def test_a_router_stall_longer_than_the_heartbeat_deadline_kills_no_replica() -> None:
    # in-process the router and the fakes share one event loop: an Info that blocks it stalls the
    # router with its polls in flight (as a long GC pause or a starved host would), past the 0.5 s
    # deadline; afterwards a replica that really goes is still found dead by its deadline
    async def body() -> None:
        async with fake_cluster((State.PREFILL, State.DECODE, State.DECODE)) as (sched, fakes):
            for fake in fakes[1:]:
                fake.step_delay = 0.02
            tasks = [asyncio.create_task(collect(sched.submit(request([6, i], 40)))) for i in range(4)]
            await eventually_async(lambda: sum(f.calls.count("DecodeV2") for f in fakes) >= 4)
            fakes[0].info_stalls = [0.8, 0.05, 0.8]  # two stalls, a poll apart
            await eventually_async(lambda: not fakes[0].info_stalls)
            results = await asyncio.gather(*tasks)
            assert [tokens_of(r) for r in results] == [expected_tokens([6, i], 40) for i in range(4)]
            assert [sched.replicas[ReplicaId(i)].state.role for i in range(3)] == [
                State.PREFILL, State.DECODE, State.DECODE]
            await fakes[2].stop()
            await eventually_async(lambda: sched.replicas[ReplicaId(2)].state.role is State.DEAD, 5)
    run(body())


def test_missed_heartbeat_marks_dead_and_requeues() -> None:
    async def body() -> None:
        now = [1000.0]
        fabric = FakeFabric()
        fakes = [FakeReplica(0, fabric), FakeReplica(1, fabric)]
        fakes[1].step_delay = 0.02
        sched = scheduler(config(Strategy.FULL), clock=lambda: now[0])
        try:
            await sched.add_replica(await fakes[0].start(), State.PREFILL)
            await sched.add_replica(await fakes[1].start(), State.DECODE, registered=True)
            task = asyncio.create_task(collect(sched.submit(request([5], 30))))
            await eventually_async(lambda: fakes[1].calls.count("DecodeV2") >= 3)
            now[0] += 0.3
            assert sched.heartbeat(ReplicaId(1))
            await sched.check_liveness()
            assert sched.replicas[ReplicaId(1)].state.role is State.DECODE
            now[0] += 0.6
            await sched.check_liveness()
            assert sched.replicas[ReplicaId(1)].state.role is State.DEAD
            assert not sched.heartbeat(ReplicaId(1))
            events = await task
            assert tokens_of(events) == expected_tokens([5], 30)
        finally:
            await sched.stop()
            for f in fakes:
                await f.stop()
    run(body())


def test_activation_failure_leaves_the_replica_inactive() -> None:
    async def body() -> None:
        async with fake_cluster((State.COLOCATED, State.INACTIVE), Strategy.FULL) as (sched, fakes):
            fakes[1].weights.fail = grpc.StatusCode.UNAVAILABLE  # the transfer to it failed
            with pytest.raises(ReplicaCallError, match="WaitRdmaDone"):
                await control.activate(sched, [1], State.DECODE, None)
            assert sched.replicas[ReplicaId(1)].state.role is State.INACTIVE
    run(body())


def test_a_failed_activation_settles_every_member_so_a_retry_succeeds() -> None:
    async def body() -> None:
        async with fake_cluster((State.COLOCATED, State.INACTIVE), Strategy.FULL) as (sched, fakes):
            fakes[1].weights.fail = grpc.StatusCode.INTERNAL  # the transfer failed on the target
            with pytest.raises(ReplicaCallError, match="WaitRdmaDone"):
                await control.activate(sched, [1], State.DECODE, Method.P2P)
            assert not fakes[1].param_op and not fakes[0].param_op  # joined: nothing left in flight
            await control.activate(sched, [1], State.DECODE, Method.P2P)
            assert sched.replicas[ReplicaId(1)].state.role is State.DECODE
    run(body())


def test_a_target_unreachable_after_its_weights_arrived_is_dead_and_the_others_serve() -> None:
    async def body() -> None:
        async with fake_cluster(ONE_AND_TWO_INACTIVE, Strategy.FULL) as (sched, fakes):
            fakes[2].fail["Info"] = grpc.StatusCode.UNAVAILABLE
            with pytest.raises(Exception, match=r"replica 2 is unreachable.*activated: \[1\]"):
                await control.activate(sched, [1, 2], State.DECODE, Method.CHAIN)
            roles = [sched.replicas[ReplicaId(i)].state.role for i in (1, 2)]
            assert roles == [State.DECODE, State.DEAD]
    run(body())


def test_error_event_is_last_and_carries_a_reason() -> None:
    async def body() -> None:
        async with fake_cluster((State.COLOCATED,), Strategy.COLOCATED) as (sched, fakes):
            fakes[0].fail["PrefillV2"] = grpc.StatusCode.INVALID_ARGUMENT
            events = await collect(sched.submit(request([4], 3)))
            assert isinstance(events[-1], ErrorEvent) and "INVALID_ARGUMENT" in events[-1].message
    run(body())


def test_prefill_replica_dying_an_empty_decode_replica_takes_its_role() -> None:
    async def body() -> None:
        async with fake_cluster((State.PREFILL, State.DECODE, State.DECODE), Strategy.FULL) as (sched, fakes):
            fakes[0].step_delay = 0.5
            task = asyncio.create_task(collect(sched.submit(request([6, 6, 6], 10))))
            await eventually_async(lambda: "PrefillV2" in fakes[0].calls)
            await fakes[0].stop()
            events = await task
            assert tokens_of(events) == expected_tokens([6, 6, 6], 10)
            roles = [sched.replicas[ReplicaId(i)].state.role for i in range(3)]
            assert roles[0] is State.DEAD and State.PREFILL in roles[1:]
            route = finish_of(events).route
            assert route.prefill_replica in (1, 2) and route.decode_replica in (1, 2)
    run(body())


def test_a_prefill_refused_for_pages_the_replica_had_not_freed_yet_runs_again() -> None:
    # A replica answers Migrate before its engine thread has freed the batch's pages, and a prefill
    # sent after that answer can run before the free (RESOURCE_EXHAUSTED "need 168 KV pages, 8 of 512
    # free": without a retry the batch fails with 502). The router retries the batch once the
    # replica's own count shows the pages free.
    async def body() -> None:
        async with fake_cluster(PD, Strategy.FULL, num_blocks=6) as (sched, fakes):
            fakes[0].free_after_migrate = 0.05
            prompts = [[50 + i] * 9 for i in range(12)]  # 2 pages each: 3 fit on a replica at a time
            results = await asyncio.gather(*(collect(sched.submit(request(p, 12))) for p in prompts))
            for p, events in zip(prompts, results, strict=True):
                assert tokens_of(events) == expected_tokens(p, 12)
            assert fakes[0].refused_pages > 0  # the race happened, and nobody saw it
            await pages_back(fakes)
    run(body(), timeout=30)


def test_a_replica_on_another_fabric_is_refused_at_registration_and_the_cluster_keeps_serving() -> None:
    async def body() -> None:
        fabric = FakeFabric()
        fakes = [FakeReplica(0, fabric), FakeReplica(1, fabric), FakeReplica(2, fabric)]
        fakes[2].fabric_kind = "cuda-ipc"
        sched = scheduler(config(Strategy.FULL))
        try:
            await sched.add_replica(await fakes[0].start(), State.PREFILL)
            await sched.add_replica(await fakes[1].start(), State.DECODE, registered=True)
            with pytest.raises(ReplicaRejected, match=r"fabric cuda-ipc, but replica .* uses tcp") as refused:
                await sched.add_replica(await fakes[2].start(), State.DECODE, registered=True)
            assert refused.value.code == "FAILED_PRECONDITION" and len(sched.replicas) == 2
            events = await collect(sched.submit(request([4, 2], 5)))
            assert tokens_of(events) == expected_tokens([4, 2], 5)
        finally:
            await sched.stop()
            for f in fakes:
                await f.stop()
    run(body())


def test_a_joining_replica_and_every_live_one_connect_their_fabrics_in_the_background() -> None:
    async def body() -> None:
        fabric = FakeFabric()
        fakes = [FakeReplica(rank, fabric) for rank in range(4)]
        fakes[3].fail["ConnectPeers"] = grpc.StatusCode.UNIMPLEMENTED  # an older replica: only logged
        sched = scheduler(config(Strategy.FULL))
        try:
            for i, fake in enumerate(fakes):
                await sched.add_replica(await fake.start(), State.PREFILL if i == 0 else State.DECODE)
            # each joiner asks for every live replica; each live one for the joiner (both ends of each pair)
            await eventually_async(lambda: sorted(fakes[0].connected) == [1, 2, 3])
            await eventually_async(lambda: sorted(fakes[2].connected) == [0, 1, 3])
            assert sorted(fakes[1].connected) == [0, 2, 3] and fakes[3].connected == []  # its call failed
            events = await collect(sched.submit(request([4, 2], 5)))  # serving meanwhile and after
            assert tokens_of(events) == expected_tokens([4, 2], 5)
        finally:
            await sched.stop()
            for f in fakes:
                await f.stop()
    run(body())
