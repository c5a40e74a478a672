"""Decode planned against a TPOT SLO on hand-made snapshots: measured TPOT and decode batch against
their limits and the migration backlog scale up, page use only bounds from above (a mostly empty GPU
pool no longer says "scale down"), and a scale-down needs the smaller cluster under `tpot_lower` of
the SLO for `cooldown` seconds."""

from __future__ import annotations

import pytest

from router.scaling.planner import Bounds, Direction, ReplicaSample, Snapshot, decode_band, plan
from router.scaling.rates import Rates
from router.states import State
from router.types import ReplicaId

B = Bounds(max_prefill=2, max_decode=3, tpot_slo=0.1, decode_batch_limit=32, cooldown=5.0)
P, D = State.PREFILL, State.DECODE


def decode(i: int, batch: int = 0, tpot: float = 0.0, used: int = 0) -> ReplicaSample:
    return ReplicaSample(ReplicaId(i), D, used, 1000, batch=batch, tpot=tpot)


def snap(*decodes: ReplicaSample, calm_since: float | None = None, **kw: float) -> Snapshot:
    replicas = (ReplicaSample(ReplicaId(0), P, 0, 1000), *decodes,
                ReplicaSample(ReplicaId(9), State.INACTIVE, 0, 1000))
    return Snapshot(now=100.0, replicas=replicas, prefill_tokens_per_s=10_000.0,
                    migration_tokens_per_s=kw.pop("migration_rate", 10_000.0), decode_calm_since=calm_since,
                    **kw)  # type: ignore[arg-type]


def test_a_tpot_above_the_slo_scales_decode_up() -> None:
    s = snap(decode(1, batch=8, tpot=0.15))  # 150 ms per step against 100
    assert decode_band(s, B)[0] == 2
    decided = plan(s, B)
    assert decided.decode.direction is Direction.UP and decided.loads["decode_tpot_s"] == pytest.approx(0.15)


def test_a_batch_beyond_the_limit_or_a_migration_backlog_scales_decode_up() -> None:
    assert plan(snap(decode(1, batch=40, tpot=0.02)), B).decode.direction is Direction.UP
    backlog = snap(decode(1, batch=4, tpot=0.02), migrating_tokens=30_000)  # 3 s of KV against 2
    assert plan(backlog, B).decode.direction is Direction.UP


def test_pages_bound_decode_from_above_but_an_empty_pool_keeps_a_loaded_cluster() -> None:
    # 3 % of the pages in use, TPOT at 60 % of the SLO over two replicas: one would be at 120 %
    busy = snap(decode(1, batch=8, tpot=0.06, used=30), decode(2, batch=8, tpot=0.06, used=30),
                calm_since=0.0)
    assert plan(busy, B).decode.direction is Direction.STAY
    full = snap(decode(1, batch=2, tpot=0.01, used=900))  # 90 % of the pages: more, whatever TPOT says
    assert plan(full, B).decode.direction is Direction.UP


def test_scale_down_only_after_the_smaller_cluster_stayed_under_the_lower_bound_for_the_cooldown() -> None:
    quiet = (decode(1, batch=2, tpot=0.01), decode(2, batch=0))
    assert plan(snap(*quiet), B).decode_calm  # the load allows one fewer: the calm clock starts
    assert plan(snap(*quiet), B).decode.delta == 0
    assert plan(snap(*quiet, calm_since=97.0), B).decode.delta == 0  # 3 s of calm < 5 s
    assert plan(snap(*quiet, calm_since=95.0), B).decode.delta == -1
    # within the hysteresis band (TPOT 70 ms on one replica: under the SLO, over half of it): stay
    band = snap(decode(1, batch=4, tpot=0.035), decode(2, batch=4, tpot=0.035), calm_since=0.0)
    decided = plan(band, B)
    assert decided.decode.delta == 0 and not decided.decode_calm


def test_without_a_tpot_slo_decode_is_planned_on_pages_as_before() -> None:
    pages_only = Bounds(max_decode=3)
    s = snap(decode(1, batch=8, tpot=0.5, used=100), decode(2, batch=8, tpot=0.5, used=100))
    assert plan(s, pages_only).decode.direction is Direction.DOWN  # 10 % of pages < 0.45


def test_tpot_is_measured_between_steps_of_a_running_batch_only() -> None:
    rates = Rates()
    for t in (10.00, 10.02, 10.04):  # a running batch: 20 ms steps
        rates.stepped(1, t)
    assert rates.tpot(1) == pytest.approx(0.02)
    rates.stepped(1, 10.06, continuing=False)  # the batch ended
    rates.stepped(1, 10.50)  # a new batch 0.44 s later: a pause, not a step
    rates.stepped(1, 10.52)
    assert rates.tpot(1) == pytest.approx(0.02)
    rates.stepped(2, 0.0)
    rates.stepped(2, 5.0)  # longer than STEP_GAP_S: idle
    assert rates.tpot(2) == 0.0


def test_the_surge_window_sees_a_step_in_load_the_average_does_not() -> None:
    rates = Rates(window=5.0, surge_window=0.5)
    for i in range(5):
        rates.arrived(1000, 100.0 + 0.1 * i)
    assert rates.surge.rate(100.45) == pytest.approx(10_000.0)
    assert rates.arrivals.rate(100.45) == pytest.approx(1_000.0)
