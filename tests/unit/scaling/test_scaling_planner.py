"""The planner on hand-made snapshots: bursts, idle rounds, bounds, keep-alive, no oscillation."""

from __future__ import annotations

import pytest

from router.scaling.planner import Bounds, Direction, ReplicaSample, Snapshot, plan
from router.states import State
from router.types import ReplicaId

PAGES = 100


def replica(i: int, state: State, used: int = 0, idle_since: float | None = None,
            transfers: int = 0) -> ReplicaSample:
    return ReplicaSample(ReplicaId(i), state, used, PAGES, transfers, idle_since)


def cluster(*states: State, used: int = 0) -> tuple[ReplicaSample, ...]:
    return tuple(replica(i, s, used if s is State.DECODE else 0) for i, s in enumerate(states))


BASE = cluster(State.PREFILL, State.DECODE, State.INACTIVE, State.INACTIVE)
BOUNDS = Bounds(min_prefill=1, max_prefill=4, min_decode=1, max_decode=4, keep_alive=5.0)


def snap(replicas: tuple[ReplicaSample, ...] = BASE, now: float = 100.0, **kw: float) -> Snapshot:
    return Snapshot(now=now, replicas=replicas, prefill_tokens_per_s=1000.0, migration_tokens_per_s=1000.0,
                    **kw)  # type: ignore[arg-type]


def test_a_burst_of_queued_prompts_scales_prefill_up_to_the_band_middle() -> None:
    # 2 s of prompt work on one replica: needs ceil(2/0.4)=5 → clamped at max 4; middle of [4, 4]
    p = plan(snap(waiting_prefill_tokens=2000), BOUNDS)
    assert p.prefill.direction is Direction.UP
    assert (p.prefill.low, p.prefill.high, p.prefill.delta) == (4, 4, 3)


def test_a_moderate_backlog_aims_at_the_middle_of_the_band() -> None:
    # 0.5 s of work: low = ceil(0.5/0.4) = 2, high = ceil(0.5/0.15) = 4 → target 3
    p = plan(snap(waiting_prefill_tokens=500), BOUNDS)
    assert (p.prefill.low, p.prefill.high, p.prefill.delta) == (2, 4, 2)


def test_decode_pages_over_the_upper_bound_scale_decode_up() -> None:
    # 90 of 100 pages in use on the one decode replica: low = ceil(90/0.8/100) = 2, high = 2
    p = plan(snap(cluster(State.PREFILL, State.DECODE, State.INACTIVE, used=90)), BOUNDS)
    assert p.decode.direction is Direction.UP and p.decode.delta == 1


def test_a_migration_backlog_asks_for_decode_replicas_too() -> None:
    # 5000 tokens waiting to migrate at 1000 tokens/s per decode replica, at most 2 s: 3 replicas
    p = plan(snap(cluster(State.PREFILL, State.DECODE, used=50), migrating_tokens=5000), BOUNDS)
    assert p.decode.low == 3 and p.decode.delta > 0


def test_an_idle_cluster_scales_down_one_replica_per_round() -> None:
    busy = cluster(State.PREFILL, State.PREFILL, State.PREFILL, State.DECODE, State.DECODE, State.DECODE)
    p = plan(snap(busy), BOUNDS)
    assert (p.prefill.delta, p.decode.delta) == (-1, -1)


def test_never_below_the_minimum() -> None:
    p = plan(snap(cluster(State.PREFILL, State.DECODE)), BOUNDS)
    assert p.idle
    bounds = Bounds(min_prefill=2, max_prefill=4, min_decode=2, max_decode=4)
    up = plan(snap(cluster(State.PREFILL, State.DECODE)), bounds)
    assert (up.prefill.delta, up.decode.delta) == (1, 1)


def test_never_above_the_maximum() -> None:
    four = cluster(State.PREFILL, State.PREFILL, State.PREFILL, State.PREFILL, State.DECODE)
    assert plan(snap(four, waiting_prefill_tokens=10**6), BOUNDS).prefill.delta == 0


@pytest.mark.parametrize("waiting", [400, 600, 1000, 1200])
def test_a_load_between_the_bounds_causes_no_action(waiting: int) -> None:
    # three prefill replicas: 0.4 s .. 1.2 s of work per... band [ceil(w/0.4), ceil(w/0.15)] contains 3
    three = cluster(State.PREFILL, State.PREFILL, State.PREFILL, State.DECODE)
    p = plan(snap(three, waiting_prefill_tokens=waiting), Bounds(max_prefill=8))
    assert p.prefill.low <= 3 <= p.prefill.high
    assert p.prefill.delta == 0


def test_a_steady_load_whose_queue_is_empty_keeps_its_prefill_replicas() -> None:
    # prompts arrive at 1500 tokens/s, each replica prefills 1000/s: nothing waits, but two are busy
    two = cluster(State.PREFILL, State.PREFILL, State.DECODE)
    p = plan(snap(two, arriving_tokens_per_s=1500.0), BOUNDS)
    assert p.prefill.delta == 0
    assert plan(snap(two, arriving_tokens_per_s=0.0), BOUNDS).prefill.delta == -1


def test_replicas_already_loading_count_for_their_kind() -> None:
    loading = cluster(State.PREFILL, State.LOADING_PREFILL, State.NEW_PREFILL, State.DECODE)
    p = plan(snap(loading, waiting_prefill_tokens=500), BOUNDS)  # wants 3: already there
    assert p.prefill.current == 3 and p.prefill.delta == 0


def test_no_measured_speed_means_no_prefill_decision() -> None:
    s = Snapshot(now=0.0, replicas=BASE, waiting_prefill_tokens=10**6)
    assert plan(s, BOUNDS).prefill.delta == 0


def test_idle_replicas_expire_after_the_keep_alive_one_per_round() -> None:
    replicas = (*cluster(State.PREFILL, State.DECODE),
                replica(5, State.IDLE, idle_since=90.0), replica(6, State.IDLE, idle_since=94.0),
                replica(7, State.IDLE, idle_since=97.0))
    assert plan(snap(replicas), BOUNDS).expire == (ReplicaId(5),)
    assert plan(snap(replicas, now=94.9), BOUNDS).expire == ()  # 4.9 s < keep-alive


def test_no_expiry_while_scaling_up() -> None:
    replicas = (*cluster(State.PREFILL, State.DECODE), replica(5, State.IDLE, idle_since=0.0))
    assert plan(snap(replicas, waiting_prefill_tokens=2000), BOUNDS).expire == ()


def test_the_plan_records_the_loads_it_came_from() -> None:
    p = plan(snap(waiting_prefill_tokens=500, waiting_requests=3), BOUNDS)
    assert p.loads["prefill_backlog_s"] == pytest.approx(0.5)
    assert p.loads["waiting_requests"] == 3.0


@pytest.mark.parametrize("kwargs", [
    {"min_prefill": 3, "max_prefill": 2},
    {"min_decode": 5, "max_decode": 1},
    {"prefill_lower": 0.5, "prefill_upper": 0.5},
    {"decode_lower": 0.9, "decode_upper": 0.8},
    {"decode_upper": 1.5},
    {"migration_upper": 0.0},
    {"keep_alive": -1.0},
    {"prefill_busy_lower": 0.9, "prefill_busy_upper": 0.5},
])
def test_contradicting_bounds_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Bounds(**kwargs)  # type: ignore[arg-type]


def test_no_scale_down_while_a_replica_of_the_kind_is_still_loading() -> None:
    # the load dipped right after a scale-up: the loading replica must not make the serving one drain
    loading = cluster(State.PREFILL, State.LOADING_PREFILL, State.DECODE, State.NEW_PREFILL)
    assert plan(snap(loading), BOUNDS).prefill.delta == 0


def test_no_scale_down_within_the_cooldown_of_the_last_scale_up() -> None:
    two = cluster(State.PREFILL, State.PREFILL, State.DECODE)
    assert plan(snap(two, prefill_up_at=98.0), BOUNDS).prefill.delta == 0  # 2 s ago, cooldown 5 s
    assert plan(snap(two, prefill_up_at=90.0), BOUNDS).prefill.delta == -1

