"""The soak's growth verdict: a steady slope over the judged window fails, noise and warm-up do not,
and a process life too short to judge is reported unjudged."""

from __future__ import annotations

import random

import pytest

from pdcluster.bench.soak.verdict import Point, slope_per_min, trend

WINDOW = (900.0, 1800.0)  # the second half of a 30-minute run


def _series(per_min: float, noise: float = 0.0, start: float = 0.0, end: float = 1800.0, base: float = 300.0
            ) -> list[Point]:
    rng = random.Random(1)
    return [Point(t, base + per_min * t / 60 + rng.uniform(-noise, noise)) for t in range(int(start), int(end)
                                                                                       + 1, 10)]


def test_slope_is_per_minute() -> None:
    assert slope_per_min([Point(0, 5), Point(60, 7), Point(120, 9)]) == pytest.approx(2.0)
    assert slope_per_min([Point(10, 5)]) == 0.0


def test_a_steady_leak_grows() -> None:
    found = trend("router", 1, "rss_mib", _series(3.0, noise=4.0), WINDOW)
    assert found.judged and found.grew and found.slope_per_min == pytest.approx(3.0, abs=0.3)
    assert trend("replica", 1, "fds", _series(0.5), WINDOW).grew  # one fd every two minutes


def test_noise_and_a_warm_up_in_the_first_half_do_not() -> None:
    warm = [Point(p.t, min(p.value, 350.0)) for p in _series(20.0)]  # grows, then flat from minute 2.5
    assert not trend("replica", 1, "rss_mib", warm, WINDOW).grew
    assert not trend("replica", 1, "rss_mib", _series(0.0, noise=6.0), WINDOW).grew
    steps = [Point(p.t, 10 + (p.t // 300) % 2 * 3) for p in _series(0.0)]  # sockets open/closed
    assert not trend("replica", 1, "fds", steps, WINDOW).grew


def test_a_slow_slope_inside_the_allowance_passes() -> None:
    assert not trend("router", 1, "rss_mib", _series(2.5), (30.0, 60.0)).grew  # 1.25 MiB in a minute's run


def test_a_short_life_is_not_judged() -> None:
    restarted = _series(50.0, start=1500.0)  # a replica restarted five minutes before the end
    found = trend("replica-2-decode", 7, "rss_mib", restarted, WINDOW)
    assert not found.judged and not found.grew and found.points == 31
    late = _series(50.0, start=870.0)  # restarted just before the window: still warming up in it
    assert not trend("replica-2-decode", 8, "rss_mib", late, WINDOW).judged
    assert trend("replica-2-decode", 9, "rss_mib", _series(50.0, start=600.0), WINDOW).grew
