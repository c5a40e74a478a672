"""Arrival processes, time and rate scaling of a replayed trace, clipping, and seeded prompts that share
Mooncake prefix blocks."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from pdcluster.bench.serving.prompts import FIRST_ID, PromptMaker
from pdcluster.bench.serving.traces import TraceRow
from pdcluster.bench.serving.workload import Arrival, Lengths, clip, gaps, offered_rate, replay, synthetic

ROWS = [TraceRow(10.0, 100, 5), TraceRow(12.0, 200, 6), TraceRow(14.0, 300, 7), TraceRow(30.0, 400, 8)]


def test_replay_shifts_to_zero_and_divides_times_by_speed() -> None:
    assert [a.at for a in replay(ROWS, speed=2.0)] == [0.0, 1.0, 2.0, 10.0]


def test_replay_scales_to_a_target_mean_rate() -> None:
    # 4 requests over 20 s: 3 gaps in 20 s = 0.15/s; at 1.5/s the span is 2 s
    scaled = replay(ROWS, rate=1.5)
    assert scaled[-1].at == pytest.approx(2.0) and offered_rate(scaled) == pytest.approx(1.5)


def test_replay_window_and_count() -> None:
    window = replay(ROWS, window=(11.0, 30.0))
    assert [(a.at, a.input_len) for a in window] == [(0.0, 200), (2.0, 300)]
    assert [a.input_len for a in replay(ROWS, num=2)] == [100, 200]
    with pytest.raises(ValueError, match="window"):
        replay(ROWS, window=(50.0, 60.0))


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_gamma_gaps_have_the_mean_and_cv_asked_for(cv: float) -> None:
    sample = gaps(20000, 4.0, cv, random.Random(1))
    mean = statistics.fmean(sample)
    assert mean == pytest.approx(0.25, rel=0.05)
    assert statistics.pstdev(sample) / mean == pytest.approx(cv, rel=0.08)


def test_synthetic_is_seeded_and_lengths_stay_in_bounds() -> None:
    one = synthetic(50, 5.0, 1.0, Lengths(10, 20), Lengths.fixed(7), seed=3)
    assert one == synthetic(50, 5.0, 1.0, Lengths(10, 20), Lengths.fixed(7), seed=3)
    assert one != synthetic(50, 5.0, 1.0, Lengths(10, 20), Lengths.fixed(7), seed=4)
    assert one[0].at == 0.0 and all(10 <= a.input_len <= 20 and a.output_len == 7 for a in one)
    assert all(a.at == 0.0 for a in synthetic(5, math.inf, 1.0, Lengths.fixed(4), Lengths.fixed(4)))
    pairs = synthetic(20, 5.0, 1.0, Lengths.fixed(1), Lengths.fixed(1), seed=0, pairs=ROWS)
    assert {(a.input_len, a.output_len) for a in pairs} <= {(r.input_len, r.output_len) for r in ROWS}


def test_clip_fits_the_model_positions_and_caps_outputs() -> None:
    fitted = clip([Arrival(0.0, 4808, 10, (1, 2)), Arrival(1.0, 5, 500)], 100, 120, max_output=50)
    assert fitted == [Arrival(0.0, 100, 10, (1, 2)), Arrival(1.0, 5, 50)]


def test_requests_sharing_hash_ids_share_those_blocks_tokens() -> None:
    maker = PromptMaker(seed=7, vocab_size=500, block_tokens=8)
    a = maker.prompt(0, Arrival(0.0, 20, 1, (0, 1, 2)))
    b = maker.prompt(1, Arrival(0.0, 20, 1, (0, 1, 9)))
    c = maker.prompt(2, Arrival(0.0, 12, 1, (5,)))
    assert len(a) == len(b) == 20 and len(c) == 12
    assert a[:16] == b[:16]  # blocks 0 and 1
    assert a[16:] != b[16:]  # block 2 vs block 9
    assert c[:8] == maker.block(5) and c[:8] != a[:8]
    assert all(FIRST_ID <= t < 500 for t in a + c)


def test_prompts_are_deterministic_from_the_seed() -> None:
    arrivals = [Arrival(0.0, 30, 1), Arrival(0.0, 30, 1)]
    first = PromptMaker(1, 300).prompts(arrivals)
    assert first == PromptMaker(1, 300).prompts(arrivals)
    assert first[0] != first[1]  # requests without hash ids do not share tokens
    assert first != PromptMaker(2, 300).prompts(arrivals)
