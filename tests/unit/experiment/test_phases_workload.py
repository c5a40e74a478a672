"""The `phases` workload kind: Poisson arrivals whose rate steps from phase to phase (a quiet phase, a
burst, quiet again), read from the experiment file and checked."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from pdcluster.bench.serving.sender import Served
from pdcluster.bench.serving.workload import Lengths, Phase, phase_starts, phased
from pdcluster.experiment.load import ExperimentError, load_experiment
from pdcluster.experiment.matrix import expand
from pdcluster.experiment.workloads import arrivals

QUIET_BURST_QUIET = [Phase(20.0, 1.0), Phase(10.0, 8.0), Phase(30.0, 1.0)]


def test_each_phase_has_its_own_rate_and_nothing_crosses_a_boundary() -> None:
    counts: list[list[int]] = [[], [], []]
    for seed in range(200):
        got = phased(QUIET_BURST_QUIET, Lengths.fixed(8), Lengths.fixed(4), seed)
        assert all(0 <= a.at < 60.0 for a in got) and got == sorted(got, key=lambda a: a.at)
        for i, (start, phase) in enumerate(zip(phase_starts(QUIET_BURST_QUIET), QUIET_BURST_QUIET,
                                               strict=True)):
            counts[i].append(sum(start <= a.at < start + phase.seconds for a in got))
    # Poisson counts: mean rate × seconds (20, 80, 30), within a few standard errors over 200 seeds
    for count, phase in zip(counts, QUIET_BURST_QUIET, strict=True):
        assert statistics.fmean(count) == pytest.approx(phase.rate * phase.seconds, rel=0.1)


def test_phases_are_seeded_capped_by_num_and_a_silent_phase_sends_nothing() -> None:
    phases = [Phase(5.0, 0.0), Phase(5.0, 4.0)]
    one = phased(phases, Lengths(10, 20), Lengths.fixed(3), seed=1)
    assert one == phased(phases, Lengths(10, 20), Lengths.fixed(3), seed=1)
    assert one != phased(phases, Lengths(10, 20), Lengths.fixed(3), seed=2)
    assert one and all(5.0 <= a.at < 10.0 and 10 <= a.input_len <= 20 for a in one)
    assert phased(phases, Lengths(10, 20), Lengths.fixed(3), seed=1, num=3) == one[:3]
    with pytest.raises(ValueError, match="rate > 0"):
        phased([Phase(5.0, 0.0)], Lengths.fixed(1), Lengths.fixed(1))
    with pytest.raises(ValueError, match="seconds"):
        Phase(0.0, 1.0)


BASE = """
name = "t"
strategies = ["full"]
[model]
path = "m"
[[clusters]]
name = "1p1d"
[[workloads]]
name = "burst"
arrival = "phases"
input_len = [8, 64]
output_len = 16
"""


def load(tmp_path: Path, extra: str) -> object:
    path = tmp_path / "exp.toml"
    path.write_text(BASE + extra)
    return load_experiment(path)


def test_a_phases_workload_is_read_with_its_mean_rate(tmp_path: Path) -> None:
    experiment = load(tmp_path, "phases = [[20, 1], [10, 8.5], [30, 1]]\n")
    (cell,) = expand(experiment)  # type: ignore[arg-type]
    spec = cell.workload
    assert spec.arrival == "phases" and spec.phases == ((20.0, 1.0), (10.0, 8.5), (30.0, 1.0))
    assert spec.rate == pytest.approx((20 + 85 + 30) / 60) and spec.num == 0
    served = Served("m", 4096, 4096, 512)
    sent = arrivals(spec, cell.seed, served)
    assert sent == phased([Phase(*p) for p in spec.phases], Lengths(8, 64), Lengths.fixed(16), cell.seed)


@pytest.mark.parametrize(("extra", "message"), [
    ("", "missing key 'phases'"),
    ("phases = [[20, 1]]\nrate = 2\n", "not rate or rates"),
    ("phases = [[0, 1]]\n", "seconds > 0"),
    ("phases = [[5, -1]]\n", "rate >= 0"),
    ("phases = [[5, 1, 2]]\n", "[[seconds, rate]"),
    ('phases = [[5, "fast"]]\n', "[[seconds, rate]"),
    ("phases = [[5, 0], [5, 0]]\n", "a rate > 0"),
    ("phases = 3\n", "must be list"),
])
def test_bad_phases_are_refused_naming_the_key(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ExperimentError, match="workloads\\[0\\]") as caught:
        load(tmp_path, extra)
    assert message in str(caught.value)


def test_phases_need_the_phases_arrival(tmp_path: Path) -> None:
    text = BASE.replace('arrival = "phases"', 'arrival = "poisson"\nrate = 2\nnum = 5')
    path = tmp_path / "exp.toml"
    path.write_text(text + "phases = [[5, 1]]\n")
    with pytest.raises(ExperimentError, match='phases needs arrival = "phases"'):
        load_experiment(path)
