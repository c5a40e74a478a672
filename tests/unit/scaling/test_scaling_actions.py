"""The executor's choices: which replicas, which method, in the documented order of preference."""

from __future__ import annotations

from router.scaling.actions import (
    Capabilities,
    Drain,
    Expire,
    Kind,
    Load,
    Mutate,
    Reactivate,
    Revive,
    choose,
)
from router.scaling.planner import KindPlan, Plan, ReplicaSample, Snapshot
from router.states import State
from router.types import ReplicaId
from router.weights import Method

MULTICAST = Capabilities((Method.TANZ, Method.CHAIN, Method.P2P, Method.LOAD_DISK))
LIVE = Capabilities(MULTICAST.methods, live=True)
STOP_THE_WORLD = Capabilities((Method.LOAD_DISK,), mutate=False)


def r(i: int, state: State, used: int = 0, transfers: int = 0) -> ReplicaSample:
    return ReplicaSample(ReplicaId(i), state, used, 100, transfers)


def want(prefill: int = 0, decode: int = 0, expire: tuple[int, ...] = ()) -> Plan:
    return Plan(KindPlan(0, 0, 0, prefill), KindPlan(0, 0, 0, decode), tuple(ReplicaId(i) for i in expire))


def snap(*replicas: ReplicaSample) -> Snapshot:
    return Snapshot(now=0.0, replicas=replicas)


def ids(*values: int) -> tuple[ReplicaId, ...]:
    return tuple(ReplicaId(v) for v in values)


def test_reviving_a_draining_replica_comes_first() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.DRAINING_PREFILL, 5), r(2, State.IDLE), r(3, State.INACTIVE))
    assert choose(want(prefill=1), s, MULTICAST) == [Revive(ReplicaId(1), Kind.PREFILL)]


def test_then_an_idle_replica_that_kept_its_weights() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.DECODE), r(2, State.IDLE), r(3, State.INACTIVE))
    assert choose(want(decode=1), s, MULTICAST) == [Reactivate(ReplicaId(2), Kind.DECODE)]


def test_a_policy_without_reuse_loads_instead_of_reactivating() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.IDLE), r(2, State.INACTIVE))
    caps = Capabilities((Method.LOAD_DISK,), reuse_idle=False)
    assert choose(want(prefill=1), s, caps) == [Load(Method.LOAD_DISK, (), ids(2), Kind.PREFILL)]


def test_tanz_with_two_sources_and_two_targets_sourcing_from_decode_first() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.DECODE, 50), r(2, State.DECODE, 10),
             r(3, State.INACTIVE), r(4, State.INACTIVE))
    [load] = choose(want(prefill=2), s, MULTICAST)
    assert load == Load(Method.TANZ, ids(2, 1), ids(3, 4), Kind.PREFILL)


def test_tanz_lanes_divide_the_targets_else_chain() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.DECODE), r(2, State.DECODE),
             r(3, State.INACTIVE), r(4, State.INACTIVE), r(5, State.INACTIVE))
    [load] = choose(want(decode=3), s, MULTICAST)  # 3 targets over 2 sources: no equal lanes
    assert load == Load(Method.CHAIN, ids(1), ids(3, 4, 5), Kind.DECODE)


def test_one_source_and_several_targets_is_a_chain() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.INACTIVE), r(2, State.INACTIVE))
    [load] = choose(want(prefill=2), s, MULTICAST)
    assert load == Load(Method.CHAIN, ids(0), ids(1, 2), Kind.PREFILL)


def test_one_target_is_p2p() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.DECODE), r(2, State.INACTIVE))
    assert choose(want(prefill=1), s, MULTICAST) == [Load(Method.P2P, ids(1), ids(2), Kind.PREFILL)]


def test_no_replica_holding_weights_loads_from_the_model_root() -> None:
    s = snap(r(0, State.INACTIVE), r(1, State.INACTIVE))
    assert choose(want(prefill=1, decode=1), s, MULTICAST) == [
        Load(Method.LOAD_DISK, (), ids(0), Kind.PREFILL), Load(Method.LOAD_DISK, (), ids(1), Kind.DECODE)]


def test_live_policy_marks_new_prefill_replicas_live_not_decode_ones() -> None:
    s = snap(r(0, State.DECODE), r(1, State.INACTIVE), r(2, State.INACTIVE))
    got = choose(want(prefill=1, decode=1), s, LIVE)
    assert got == [Load(Method.P2P, ids(0), ids(1), Kind.PREFILL, live=True)]
    # the only source is busy now: the decode target waits for a later round


def test_stop_the_world_loads_every_target_from_disk() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.DECODE), r(2, State.INACTIVE), r(3, State.INACTIVE))
    assert choose(want(prefill=2), s, STOP_THE_WORLD) == [Load(Method.LOAD_DISK, (), ids(2, 3), Kind.PREFILL)]


def test_prefill_down_and_decode_up_mutates_the_least_loaded_prefill_replica() -> None:
    s = snap(r(0, State.PREFILL, 30), r(1, State.PREFILL, 10), r(2, State.DECODE), r(3, State.INACTIVE))
    assert choose(want(prefill=-1, decode=1), s, MULTICAST) == [Mutate(ReplicaId(1))]


def test_without_mutation_prefill_down_drains_and_decode_loads() -> None:
    s = snap(r(0, State.PREFILL, 30), r(1, State.PREFILL, 10), r(2, State.DECODE), r(3, State.INACTIVE))
    caps = Capabilities(MULTICAST.methods, mutate=False)
    assert choose(want(prefill=-1, decode=1), s, caps) == [
        Drain(ReplicaId(1)), Load(Method.P2P, ids(2), ids(3), Kind.DECODE)]


def test_scale_down_drains_the_least_loaded_replica_of_the_kind() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.DECODE, 40), r(2, State.DECODE, 5), r(3, State.DECODE, 20))
    assert choose(want(decode=-1), s, MULTICAST) == [Drain(ReplicaId(2))]


def test_expiry_resets_idle_replicas_named_by_the_plan() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.DECODE), r(2, State.IDLE))
    assert choose(want(expire=(2,)), s, MULTICAST) == [Expire(ReplicaId(2))]


def test_a_replica_busy_with_a_scaling_action_is_never_chosen() -> None:
    s = snap(r(0, State.DECODE, transfers=1), r(1, State.DRAINING_PREFILL, transfers=1),
             r(2, State.INACTIVE, transfers=1), r(3, State.INACTIVE))
    # the sources are busy: the free target waits for a later round rather than load from disk
    assert choose(want(prefill=2), s, MULTICAST) == []


def test_prefill_replicas_send_weights_only_when_no_other_replica_can() -> None:
    s = snap(r(0, State.PREFILL), r(1, State.PREFILL), r(2, State.INACTIVE), r(3, State.INACTIVE))
    [load] = choose(want(decode=2), s, MULTICAST)
    assert load == Load(Method.TANZ, ids(0, 1), ids(2, 3), Kind.DECODE)


def test_nothing_to_do() -> None:
    assert choose(want(), snap(r(0, State.PREFILL), r(1, State.DECODE)), MULTICAST) == []


def test_a_replica_is_used_by_one_action_only() -> None:
    s = snap(r(0, State.DECODE), r(1, State.IDLE), r(2, State.INACTIVE), r(3, State.INACTIVE))
    actions = choose(want(prefill=2, decode=1), s, MULTICAST)
    named: list[ReplicaId] = []
    for a in actions:
        if isinstance(a, Load):
            named += [*a.sources, *a.targets]
        else:
            named.append(a.replica)
    assert len(named) == len(set(named))


def tp(i: int, state: State, size: int) -> ReplicaSample:
    return ReplicaSample(ReplicaId(i), state, 0, 100, tp=size)


def test_a_group_counts_as_one_replica_and_takes_weights_from_groups_of_its_size() -> None:
    s = snap(tp(0, State.DECODE, 1), tp(1, State.DECODE, 2), tp(2, State.INACTIVE, 2),
             tp(3, State.INACTIVE, 2))
    assert choose(want(decode=2), s, MULTICAST) == [Load(Method.CHAIN, ids(1), ids(2, 3), Kind.DECODE)]
    # only a tp1 replica holds weights: the tp2 group loads from the model root instead
    s = snap(tp(0, State.DECODE, 1), tp(2, State.INACTIVE, 2))
    assert choose(want(decode=1), s, MULTICAST) == [Load(Method.LOAD_DISK, (), ids(2), Kind.DECODE)]
