"""Role state machine, loop modes per strategy, destination choice, heartbeat expiry (fake clock)."""

from __future__ import annotations

import pytest

from router import strategies
from router.config import RouterConfig, Strategy
from router.replicas import Heartbeats, ReplicaState, Role, TransitionError, check_transition
from router.strategies.base import Mode
from router.strategies.base import most_free_pages as choose_destination
from router.types import ReplicaId, ReplicaInfo, RequestId


def info(total: int = 100) -> ReplicaInfo:
    return ReplicaInfo(model_id="m", dtype="float32", num_layers=2, block_size=16, num_blocks_total=total,
                       num_blocks_free=total, rank=0, max_input_tokens=100, max_total_tokens=200,
                       num_layers_loaded=2, embed_ready=True, lm_head_ready=True)


def replica(rid: int, role: Role = Role.DECODE, total: int = 100, held: int = 0, inbound: int = 0
            ) -> ReplicaState:
    state = ReplicaState(ReplicaId(rid), f"h:{rid}", info(total), role, inbound=inbound)
    if held:
        state.hold({RequestId(1000 + rid): held})
    return state


def test_allowed_and_refused_transitions() -> None:
    check_transition(Role.PREFILL, Role.MUTATING_TO_DECODE)
    check_transition(Role.MUTATING_TO_DECODE, Role.DECODE)
    check_transition(Role.INACTIVE, Role.LOADING)
    check_transition(Role.LOADING, Role.PREFILL)
    check_transition(Role.DRAINING, Role.IDLE)
    check_transition(Role.IDLE, Role.INACTIVE)
    check_transition(Role.DECODE, Role.DEAD)
    for old, new in [(Role.INACTIVE, Role.DECODE), (Role.DEAD, Role.PREFILL), (Role.DRAINING, Role.DECODE),
                     (Role.MUTATING_TO_DECODE, Role.PREFILL), (Role.DEAD, Role.DEAD)]:
        with pytest.raises(TransitionError):
            check_transition(old, new)


def test_set_role_returns_old_and_validates() -> None:
    r = replica(0, Role.PREFILL)
    assert r.set_role(Role.DRAINING) is Role.PREFILL
    with pytest.raises(TransitionError):
        r.set_role(Role.PREFILL)
    assert r.role is Role.DRAINING


def test_page_accounting() -> None:
    r = replica(0, total=10, held=3)
    r.promised = 2
    assert (r.used_blocks, r.free_blocks) == (5, 5)
    r.release([RequestId(1000)])
    assert r.free_blocks == 8


@pytest.mark.parametrize(("role", "strategy", "has_decode", "mode"), [
    (Role.PREFILL, Strategy.FULL, True, Mode.PREFILL),
    (Role.PREFILL, Strategy.FULL, False, Mode.COLOCATED),
    (Role.PREFILL, Strategy.MUTATE, False, Mode.PREFILL),
    (Role.PREFILL, Strategy.COLOCATED, True, Mode.COLOCATED),
    (Role.DECODE, Strategy.RECOMPUTE, True, Mode.DECODE),
    (Role.DECODE, Strategy.COLOCATED, True, Mode.COLOCATED),
    (Role.MUTATING_TO_DECODE, Strategy.MUTATE, True, Mode.DECODE),
    (Role.COLOCATED, Strategy.FULL, True, Mode.COLOCATED),
    (Role.DRAINING, Strategy.FULL, True, Mode.DRAIN),
    (Role.INACTIVE, Strategy.FULL, True, Mode.IDLE),
    (Role.DEAD, Strategy.FULL, True, Mode.IDLE),
])
def test_loop_mode_per_role_and_strategy(role: Role, strategy: Strategy, has_decode: bool, mode: Mode
                                         ) -> None:
    assert strategies.get(strategy).mode(role, has_decode) is mode


def test_destination_is_the_decode_replica_with_most_free_pages() -> None:
    reps = [replica(0, Role.PREFILL, total=500), replica(1, held=50), replica(2, held=10), replica(3, held=5,
                                                                                                   inbound=2)]
    chosen = choose_destination(reps, need_blocks=20, max_inbound=2)
    assert chosen is not None and chosen.id == 2


def test_destination_respects_capacity_inbound_bound_and_role() -> None:
    reps = [replica(1, held=95), replica(2, inbound=1), replica(3, Role.DRAINING), replica(4, Role.DEAD)]
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
    (Role.DECODE, [Role.PREFILL], Role.DECODE),
    (Role.PREFILL, [Role.DECODE], Role.PREFILL),
    (Role.PREFILL, [Role.PREFILL], Role.DECODE),  # another replica took over prefill meanwhile
    (Role.MUTATING_TO_DECODE, [], Role.DECODE),
    (Role.LOADING, [], Role.INACTIVE),
    (Role.DRAINING, [], Role.IDLE),
    (Role.COLOCATED, [], Role.COLOCATED),
])
def test_a_dead_replica_that_answers_again_gets_its_settled_role_back(
    before: Role, others: list[Role], after: Role
) -> None:
    state = ReplicaState(ReplicaId(1), "h:1", info(8), before)
    state.set_role(Role.DEAD)
    assert state.revive(others) is after and state.role is after
    with pytest.raises(TransitionError):
        state.revive(others)  # only a dead one


def test_a_revived_replica_without_its_weights_is_inactive() -> None:
    state = ReplicaState(ReplicaId(1), "h:1", info(8), Role.DECODE)
    state.set_role(Role.DEAD)
    state.info = ReplicaInfo(**{**state.info.__dict__, "num_layers_loaded": 0})
    assert state.revive([]) is Role.INACTIVE
