"""Several models in one router, the pure parts (`router/models.py`): parsing `--models`, which
model borrows or gives back shared inactive replicas, and how a model at zero gets a replica."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import RouterConfig
from router.models import Held, HostCopies, PoolNeed, parse_model, rebalance, reclaim_order, wake_action
from router.scaling.actions import Kind, Load, Reactivate
from router.scaling.planner import Bounds, ReplicaSample
from router.scaling.policies import get
from router.states import State
from router.types import ReplicaId
from router.weights import Method


def sample(rid: int, state: State, transfers: int = 0) -> ReplicaSample:
    return ReplicaSample(ReplicaId(rid), state, 0, 100, transfers)


def test_parse_model_reads_name_folder_and_bounds() -> None:
    spec = parse_model("chat=/models/a,min-prefill=0,min-decode=0,keep-alive=2.5")
    assert (spec.name, spec.path) == ("chat", Path("/models/a"))
    bounds = spec.bounds(Bounds())
    assert (bounds.min_prefill, bounds.min_decode, bounds.keep_alive) == (0, 0, 2.5)
    assert parse_model("b=/m/b").bounds(Bounds()) == Bounds()


@pytest.mark.parametrize(("text", "says"), [
    ("/models/a", "NAME=DIR"), ("=x", "NAME=DIR"), ("a=", "NAME=DIR"),
    ("a=/m,min-prefil=0", "unknown option"), ("a=/m,min-prefill=zero", "must be a number"),
])
def test_parse_model_refuses_malformed_entries(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_model(text)


def test_config_lists_every_model_and_refuses_clashes(tmp_path: Path) -> None:
    config = RouterConfig(model=tmp_path / "base", models=[f"other={tmp_path / 'o'},min-prefill=0"])
    assert [s.name for s in config.model_specs()] == ["base", "other"]
    with pytest.raises(ValueError, match="must differ"):
        RouterConfig(model=tmp_path / "base", models=[f"base={tmp_path / 'o'}"])
    with pytest.raises(ValueError, match="min_prefill"):  # the override contradicts max-prefill
        RouterConfig(model=tmp_path / "base", models=[f"o={tmp_path / 'o'},min-prefill=9"])


def test_a_model_that_wants_nothing_gives_its_inactive_replicas_back_to_one_that_wakes() -> None:
    ids = (ReplicaId(4), ReplicaId(5))
    decided = rebalance({"a": PoolNeed(0, ids), "b": PoolNeed(0, (), waking=True)}, spare=0)
    assert decided.release == {"a": ids}
    assert decided.lend == {"b": 1}


def test_waking_models_borrow_first_then_the_largest_shortfall() -> None:
    needs = {"a": PoolNeed(3), "b": PoolNeed(1, (), waking=True), "c": PoolNeed(2, (ReplicaId(1),))}
    assert rebalance(needs, spare=2).lend == {"b": 1, "a": 1}
    assert rebalance(needs, spare=9).lend == {"b": 1, "a": 3, "c": 1}
    assert rebalance(needs, spare=0).lend == {}


def test_a_model_with_enough_inactive_replicas_borrows_none_and_keeps_them_while_it_wants() -> None:
    decided = rebalance({"a": PoolNeed(1, (ReplicaId(2),))}, spare=3)
    assert (decided.lend, decided.release) == ({}, {})


def test_wake_prefers_an_idle_replica_then_p2p_then_loadparams() -> None:
    live = get("live").caps
    assert wake_action([sample(1, State.INACTIVE), sample(2, State.IDLE)], live) == Reactivate(
        ReplicaId(2), Kind.PREFILL)
    assert wake_action([sample(1, State.INACTIVE), sample(3, State.DECODE)], live) == Load(
        Method.P2P, (ReplicaId(3),), (ReplicaId(1),), Kind.PREFILL)
    loaded = wake_action([sample(1, State.INACTIVE)], live)
    assert isinstance(loaded, Load) and loaded.method is Method.LOAD_HOST and loaded.targets == (1,)


@pytest.mark.parametrize(("policy", "method"), [
    ("host-cache", Method.LOAD_HOST), ("stop-the-world", Method.LOAD_DISK),
    ("multicast", Method.LOAD_HOST), ("static", Method.LOAD_HOST)])
def test_wake_reads_the_host_cache_unless_the_policy_only_loads_from_disk(policy: str,
                                                                         method: Method) -> None:
    action = wake_action([sample(1, State.INACTIVE), sample(2, State.IDLE, transfers=1)], get(policy).caps)
    assert isinstance(action, Load) and action.method is method


def test_wake_skips_busy_replicas() -> None:
    assert wake_action([sample(1, State.INACTIVE, transfers=1)], get("live").caps) is None
    assert wake_action([], get("live").caps) is None



def test_wake_order_own_host_copy_then_a_peers_then_disk() -> None:
    live, cold = get("live").caps, [sample(1, State.INACTIVE), sample(2, State.INACTIVE)]
    peers = [HostCopies("h:9", frozenset({"m"})), HostCopies("h:3", frozenset({"m", "x"})),
             HostCopies("h:1", frozenset({"x"})), HostCopies("h:5", frozenset({"m"}))]
    own = {ReplicaId(2): frozenset({"m"})}
    # the target that holds the model in its own host memory, before any peer
    assert wake_action(cold, live, "m", own, peers) == Load(
        Method.LOAD_HOST, (), (ReplicaId(2),), Kind.PREFILL)
    # else the first two peers (by address) holding it send a share of their copies each
    assert wake_action(cold, live, "m", {}, peers) == Load(
        Method.HOST_PEER, (), (ReplicaId(1),), Kind.PREFILL, peers=("h:3", "h:5"))
    assert wake_action(cold, live, "x", {}, peers) == Load(
        Method.HOST_PEER, (), (ReplicaId(1),), Kind.PREFILL, peers=("h:1", "h:3"))
    # no copy anywhere: LoadParams (host cache, then disk on a miss)
    assert wake_action(cold, live, "y", own, peers) == Load(
        Method.LOAD_HOST, (), (ReplicaId(1),), Kind.PREFILL)
    # a replica of the pool that holds the weights comes first of all, a busy one does not count
    assert wake_action([*cold, sample(4, State.DECODE)], live, "m", own, peers) == Load(
        Method.P2P, (ReplicaId(4),), (ReplicaId(1),), Kind.PREFILL)
    busy = wake_action([*cold, sample(4, State.DECODE, transfers=1)], live, "m", own, peers)
    assert isinstance(busy, Load) and busy.method is Method.LOAD_HOST


@pytest.mark.parametrize(("policy", "method"), [
    ("multicast", Method.HOST_PEER), ("live", Method.HOST_PEER), ("host-cache", Method.LOAD_HOST),
    ("stop-the-world", Method.LOAD_DISK), ("static", Method.LOAD_HOST)])
def test_only_the_network_policies_wake_from_a_peers_host_copy(policy: str, method: Method) -> None:
    """host-cache is ServerlessLLM's: its own node's host cache, then SSD; stop-the-world: disk."""
    peers = [HostCopies("h:3", frozenset({"m"}))]
    holder = sample(4, State.DECODE)
    action = wake_action([sample(1, State.INACTIVE)], get(policy).caps, "m", {}, peers)
    assert isinstance(action, Load) and action.method is method and action.targets == (1,)
    own = {ReplicaId(1): frozenset({"m"})}
    if policy in ("host-cache", "stop-the-world"):  # no p2p from a holder either: not their methods
        action = wake_action([sample(1, State.INACTIVE), holder], get(policy).caps, "m", own, peers)
        assert isinstance(action, Load) and action.method is method


def test_a_wake_without_spares_reclaims_idle_replicas_first_then_the_least_requested_quiet_model() -> None:
    def held(model: str, rid: int, state: State, since: float, quiet: bool, arrivals: float) -> Held:
        return Held(model, ReplicaId(rid), state, since, quiet, arrivals)

    busy_model = held("a", 1, State.PREFILL, 0.0, False, 9.0)  # work in flight: never taken
    idle_late = held("a", 2, State.IDLE, 5.0, False, 9.0)  # its model busy: its keep-alive is still spare
    idle_early = held("b", 3, State.IDLE, 2.0, True, 1.0)
    popular, rare = held("c", 4, State.DECODE, 1.0, True, 50.0), held("d", 5, State.PREFILL, 3.0, True, 0.5)
    loading = held("e", 6, State.LOADING_PREFILL, 0.0, True, 0.0)  # mid-load: not reclaimable
    order = reclaim_order([busy_model, idle_late, popular, loading, rare, idle_early])
    assert [h.replica for h in order] == [3, 2, 5, 4]
