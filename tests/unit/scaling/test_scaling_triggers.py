"""The urgent-planning trigger on hand-made snapshots: a queue that predicts a TTFT above the SLO,
an arrival surge the prefill replicas cannot take, and what keeps it quiet (a scale-up in flight,
the maximum, nothing measured, a quiet queue). An urgent snapshot always plans prefill up."""

from __future__ import annotations

import math

import pytest

from router.scaling.planner import Bounds, Direction, ReplicaSample, Snapshot, plan
from router.scaling.triggers import predicted_ttft, urgency
from router.states import State
from router.types import ReplicaId

SPEED = 10_000.0  # one prefill replica's measured prompt tokens/s
SLO = Bounds(max_prefill=4, ttft_slo=1.0)


def snap(*states: State, **kw: float) -> Snapshot:
    replicas = tuple(ReplicaSample(ReplicaId(i), s, 0, 100) for i, s in enumerate(states))
    return Snapshot(now=10.0, replicas=replicas, prefill_tokens_per_s=kw.pop("speed", SPEED),
                    **kw)  # type: ignore[arg-type]


P, D, N = State.PREFILL, State.DECODE, State.INACTIVE


def test_the_predicted_ttft_is_the_queue_spread_over_the_prefill_replicas() -> None:
    assert predicted_ttft(snap(P, D, waiting_prefill_tokens=15_000)) == pytest.approx(1.5)
    assert predicted_ttft(snap(P, P, D, waiting_prefill_tokens=15_000)) == pytest.approx(0.75)
    assert predicted_ttft(snap(D, waiting_prefill_tokens=1)) == math.inf
    assert predicted_ttft(snap(P, D, waiting_prefill_tokens=15_000, speed=0.0)) == 0.0


def test_a_queue_predicting_a_ttft_above_the_slo_is_urgent_and_plans_up() -> None:
    s = snap(P, D, N, N, waiting_prefill_tokens=12_000)  # 1.2 s on one replica, SLO 1 s
    reason = urgency(s, SLO)
    assert reason is not None and reason.startswith("predicted TTFT 1.200 s > TTFT SLO 1 s")
    assert plan(s, SLO).prefill.direction is Direction.UP
    assert urgency(snap(P, D, N, N, waiting_prefill_tokens=9_000), SLO) is None  # 0.9 s: within


def test_without_an_slo_the_planners_upper_bound_is_the_limit() -> None:
    bounds = Bounds(max_prefill=4)  # prefill_upper 0.4 s
    reason = urgency(snap(P, D, N, waiting_prefill_tokens=5_000), bounds)
    assert reason is not None and "prefill upper bound 0.4 s" in reason
    assert urgency(snap(P, D, N, waiting_prefill_tokens=3_000), bounds) is None


def test_an_arrival_surge_beyond_the_replicas_is_urgent_before_any_queue_builds() -> None:
    s = snap(P, D, N, N, surge_tokens_per_s=12_000, arriving_tokens_per_s=3_000,
             waiting_prefill_tokens=2_000)  # > 10 k, 0.2 s queued: far from the SLO yet
    reason = urgency(s, SLO)
    assert reason is not None and reason.startswith("arrival surge 12000 tokens/s")
    decided = plan(s, SLO)
    assert decided.prefill.direction is Direction.UP and decided.loads["prefill_surge"] == pytest.approx(1.2)
    assert urgency(snap(P, D, N, N, surge_tokens_per_s=9_500, waiting_prefill_tokens=2_000), SLO) is None
    absorbed = snap(P, D, N, N, surge_tokens_per_s=12_000)  # a clump, but nothing waits: keeping up
    assert urgency(absorbed, SLO) is None and plan(absorbed, SLO).prefill.delta == 0


def test_a_scale_up_in_flight_or_the_maximum_quiets_it() -> None:
    loading = snap(P, State.LOADING_PREFILL, D, waiting_prefill_tokens=15_000)  # 0.75 s over two
    assert urgency(loading, SLO) is None
    at_max = snap(P, P, D, waiting_prefill_tokens=50_000)
    assert urgency(at_max, Bounds(max_prefill=2, ttft_slo=1.0)) is None
    assert urgency(snap(P, D, waiting_prefill_tokens=50_000, speed=0.0), SLO) is None  # nothing measured


def test_the_slo_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="ttft_slo and tpot_slo must be >= 0"):
        Bounds(ttft_slo=-1.0)
