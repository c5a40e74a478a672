"""State state machine, loop modes per strategy, destination choice, heartbeat expiry (fake clock)."""

from __future__ import annotations

import dataclasses
from typing import cast

import pytest

from router import strategies
from router.config import RouterConfig, Strategy
from router.registry import Replicas
from router.replica_api import ReplicaApi
from router.replicas import Heartbeats, ReplicaState, ServingLimits, State, TransitionError, Trigger
from router.strategies.base import Mode
from router.strategies.base import most_free_pages as choose_destination
from router.types import ReplicaId, ReplicaInfo, RequestId


def info(total: int = 100) -> ReplicaInfo:
    return ReplicaInfo(model_id="m", dtype="float32", num_layers=2, block_size=16, num_blocks_total=total,
                       num_blocks_free=total, rank=0, max_input_tokens=100, max_total_tokens=200,
                       num_layers_loaded=2, embed_ready=True, lm_head_ready=True)


def replica(rid: int, role: State = State.DECODE, total: int = 100, held: int = 0, inbound: int = 0
            ) -> ReplicaState:
    state = ReplicaState(ReplicaId(rid), f"h:{rid}", info(total), role, inbound=inbound)
    if held:
        state.hold({RequestId(1000 + rid): held})
    return state


def test_move_returns_the_old_state_validates_and_tells_the_observer() -> None:
    r = replica(0, State.PREFILL)
    seen: list[tuple[State, State, Trigger]] = []
    r.observer = lambda _state, old, new, trigger: seen.append((old, new, trigger))
    assert r.move(State.DRAINING_PREFILL, Trigger.DRAIN) is State.PREFILL
    with pytest.raises(TransitionError):
        r.move(State.PREFILL, Trigger.ASSIGN)  # only a revive brings it back
    assert r.role is State.DRAINING_PREFILL
    assert seen == [(State.PREFILL, State.DRAINING_PREFILL, Trigger.DRAIN)]


def test_page_accounting() -> None:
    r = replica(0, total=10, held=3)
    r.promised = 2
    assert (r.used_blocks, r.free_blocks) == (5, 5)
    r.hold({RequestId(1000): 4, RequestId(7): 1})  # a request's count is replaced, not added
    assert r.used_blocks == 7 == sum(r.held.values()) + 2
    r.release([RequestId(1000), RequestId(99)])  # one it never held changes nothing
    assert r.free_blocks == 7
    r.release_all()
    assert (r.held, r.used_blocks) == ({}, 2)


def test_serving_limits_follow_roles_and_info() -> None:
    replicas = Replicas()
    assert replicas.limits().replicas == 0
    a = replicas.add("h:0", info(100), State.PREFILL, cast(ReplicaApi, None))
    b = replicas.add("h:1", info(100), State.INACTIVE, cast(ReplicaApi, None))
    assert replicas.limits() == ServingLimits(1, 100, 200, 1600)
    b.state.info = dataclasses.replace(info(10), max_input_tokens=50, max_total_tokens=0)
    assert replicas.limits().max_input_tokens == 100  # b does not serve
    b.state.move(State.LOADING_DECODE, Trigger.LOAD_DECODE)
    b.state.move(State.DECODE, Trigger.LOADED)
    assert replicas.limits() == ServingLimits(2, 50, 200, 160)  # 0 = no limit: a's total stands
    a.state.info = dataclasses.replace(info(100), max_total_tokens=150)
    assert replicas.limits() == ServingLimits(2, 50, 150, 160)
    b.state.move(State.DEAD, Trigger.DIED)
    assert replicas.limits() == ServingLimits(1, 100, 150, 1600) and len(replicas.serving()) == 1


@pytest.mark.parametrize(("role", "strategy", "has_decode", "mode"), [
    (State.PREFILL, Strategy.FULL, True, Mode.PREFILL),
    (State.PREFILL, Strategy.FULL, False, Mode.COLOCATED),
    (State.PREFILL, Strategy.MUTATE, False, Mode.PREFILL),
    (State.PREFILL, Strategy.COLOCATED, True, Mode.COLOCATED),
    (State.DECODE, Strategy.RECOMPUTE, True, Mode.DECODE),
    (State.DECODE, Strategy.COLOCATED, True, Mode.COLOCATED),
    (State.MUTATING_TO_DECODE, Strategy.MUTATE, True, Mode.DECODE),
    (State.COLOCATED, Strategy.FULL, True, Mode.COLOCATED),
    (State.DRAINING_PREFILL, Strategy.FULL, True, Mode.DRAIN),
    (State.DRAINING_DECODE, Strategy.COLOCATED, True, Mode.DRAIN),
    (State.INACTIVE, Strategy.FULL, True, Mode.IDLE),
    (State.DEAD, Strategy.FULL, True, Mode.IDLE),
])
def test_loop_mode_per_role_and_strategy(role: State, strategy: Strategy, has_decode: bool, mode: Mode
                                         ) -> None:
    assert strategies.get(strategy).mode(role, has_decode) is mode


def test_destination_is_the_decode_replica_with_most_free_pages() -> None:
    reps = [replica(0, State.PREFILL, total=500), replica(1, held=50), replica(2, held=10), replica(3, held=5,
                                                                                                   inbound=2)]
    chosen = choose_destination(reps, need_blocks=20, max_inbound=2)
    assert chosen is not None and chosen.id == 2


def test_destination_respects_capacity_inbound_bound_and_role() -> None:
    reps = [replica(1, held=95), replica(2, inbound=1), replica(3, State.DRAINING_DECODE),
            replica(4, State.DEAD)]
    assert choose_destination(reps, need_blocks=10, max_inbound=1) is None
    chosen = choose_destination(reps, need_blocks=10, max_inbound=2)
    assert chosen is not None and chosen.id == 2


def test_heartbeat_expiry_with_a_fake_clock() -> None:
    hb = Heartbeats(timeout=5.0)
    hb.beat(ReplicaId(0), 100.0)
    hb.beat(ReplicaId(1), 103.0)
    assert hb.expired(104.9) == []
    assert hb.expired(105.5) == [0]
    hb.beat(ReplicaId(0), 105.5)
    assert hb.expired(108.6) == [1]
    assert hb.age(ReplicaId(0), 106.0) == pytest.approx(0.5)
    hb.forget(ReplicaId(1))
    assert hb.expired(200.0) == [0] and hb.age(ReplicaId(1), 1.0) is None


def test_a_router_stall_is_credited_to_every_deadline_up_to_now() -> None:
    hb = Heartbeats(timeout=5.0)
    hb.beat(ReplicaId(0), 100.0)
    hb.beat(ReplicaId(1), 104.0)
    hb.stalled(3.0, now=106.0)  # the router could not listen for 3 s
    assert hb.age(ReplicaId(0), 106.0) == pytest.approx(3.0)
    assert hb.age(ReplicaId(1), 106.0) == pytest.approx(0.0)  # never a beat in the future
    assert hb.expired(107.9) == [] and hb.expired(108.1) == [0]  # 100 + 3 + 5, not 105
    assert hb.expired(111.1) == [0, 1]


def test_router_config_roles_and_validation() -> None:
    assert RouterConfig(model="m", replica=["a:1"]).roles() == ["colocated"]  # type: ignore[arg-type]
    assert RouterConfig(model="m", replica=["a:1", "b:2", "c:3"]).roles() == [  # type: ignore[arg-type]
        "prefill", "decode", "decode"]
    cfg = RouterConfig(model="m", replica=["a:1", "b:2"], role=["decode", "prefill"],  # type: ignore[arg-type]
                       strategy="mutate")
    assert cfg.roles() == ["decode", "prefill"] and cfg.strategy == Strategy.MUTATE.value
    with pytest.raises(ValueError):
        RouterConfig(model="m", replica=["a:1"], role=["decode", "decode"])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RouterConfig(model="m", replica=["a:1"], role=["boss"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("before", "others", "after"), [
    (State.DECODE, [State.PREFILL], State.DECODE),
    (State.PREFILL, [State.DECODE], State.PREFILL),
    (State.PREFILL, [State.PREFILL], State.DECODE),  # another replica took over prefill meanwhile
    (State.MUTATING_TO_DECODE, [], State.DECODE),
    (State.LOADING_PREFILL, [], State.INACTIVE),
    (State.LOADING_DECODE, [], State.INACTIVE),
    (State.NEW_PREFILL, [], State.INACTIVE),
    (State.OLD_PREFILL, [], State.PREFILL),
    (State.DRAINING_PREFILL, [], State.IDLE),
    (State.DRAINING_DECODE, [], State.IDLE),
    (State.COLOCATED, [], State.COLOCATED),
])
def test_a_dead_replica_that_answers_again_gets_its_settled_role_back(
    before: State, others: list[State], after: State
) -> None:
    state = ReplicaState(ReplicaId(1), "h:1", info(8), before)
    state.move(State.DEAD, Trigger.DIED)
    assert state.revive(others) is after and state.role is after
    with pytest.raises(TransitionError):
        state.revive(others)  # only a dead one


def test_a_revived_replica_without_its_weights_is_inactive() -> None:
    state = ReplicaState(ReplicaId(1), "h:1", info(8), State.DECODE)
    state.move(State.DEAD, Trigger.DIED)
    state.info = ReplicaInfo(**{**state.info.__dict__, "num_layers_loaded": 0})
    assert state.revive([]) is State.INACTIVE


@pytest.mark.parametrize(("coming", "load"), [(State.LOADING_PREFILL, Trigger.LOAD_PREFILL),
                                              (State.NEW_PREFILL, Trigger.LIVE_LOAD)])
def test_an_empty_decode_replica_takes_the_prefill_role_only_when_none_is_on_its_way(
        coming: State, load: Trigger) -> None:
    # two loads planned in one round (a prefill, a decode): the decode one finished first
    replicas = Replicas()
    decode = replicas.add("h:0", info(), State.DECODE, cast(ReplicaApi, None))
    other = replicas.add("h:1", info(), State.INACTIVE, cast(ReplicaApi, None))
    other.state.move(coming, load)
    assert replicas.settle_roles() is None and decode.state.role is State.DECODE
    other.state.move(State.DEAD, Trigger.DIED)  # the prefill replica that was coming died
    assert replicas.settle_roles() is decode and decode.state.role is State.PREFILL


def test_receivers_are_the_decode_replicas_but_the_source_as_roles_change() -> None:
    replicas = Replicas()
    p = replicas.add("h:0", info(), State.PREFILL, cast(ReplicaApi, None))
    d = replicas.add("h:1", info(), State.DECODE, cast(ReplicaApi, None))
    i = replicas.add("h:2", info(), State.INACTIVE, cast(ReplicaApi, None))
    assert replicas.receivers(p) == [d.state] and replicas.receivers(d) == []
    i.state.move(State.LOADING_DECODE, Trigger.LOAD_DECODE)
    assert replicas.receivers(p) == [d.state]  # not until it serves
    i.state.move(State.DECODE, Trigger.LOADED)
    d.state.move(State.DEAD, Trigger.DIED)
    assert replicas.receivers(p) == [i.state]
