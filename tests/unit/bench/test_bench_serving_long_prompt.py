"""`bench serving --long-prompt-len` / `--compare-long-prompt`: the workload gets one long prompt in
the middle, the regular figures leave it out, the ratios are against the run without it, and the
local cluster gets the router flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.bench.serving.bench import BenchServingConfig, up_config
from pdcluster.bench.serving.long_prompt import long_prompt_ratios, regular_summary, with_long_prompt
from pdcluster.bench.serving.stats import RequestRecord
from pdcluster.bench.serving.workload import Arrival


def test_the_long_prompt_is_sent_with_the_middle_arrival_and_listed_last() -> None:
    arrivals = [Arrival(t, 8, 4) for t in (0.0, 1.0, 2.0, 3.0)]
    got = with_long_prompt(arrivals, 100, 4)
    assert got[:4] == arrivals and got[4] == Arrival(2.0, 100, 4)


def _record(index: int, ttft: float, itl: list[float]) -> RequestRecord:
    return RequestRecord(index, 8, len(itl) + 1, True, start=0.0, ttft=ttft, latency=ttft + sum(itl), itl=itl)


def test_regular_figures_leave_the_long_prompt_out() -> None:
    records = [_record(0, 0.1, [0.01, 0.01]), _record(1, 0.1, [0.01, 0.03]), _record(2, 0.5, [0.9, 0.9])]
    regular = regular_summary(records, long_index=2)
    assert regular["regular_max_itl_ms"] == pytest.approx(30.0)
    assert regular["regular_median_tpot_ms"] == pytest.approx(15.0)
    assert regular["long_prompt_ttft_ms"] == pytest.approx(500.0)
    everyone = regular_summary(records, long_index=-1)  # no long prompt: every request counts
    assert everyone["regular_max_itl_ms"] == pytest.approx(900.0) and everyone["long_prompt_ttft_ms"] == 0.0


def test_ratios_are_against_the_run_without_the_long_prompt() -> None:
    def run(tpot: float, itl: float) -> dict[str, float]:
        return {"regular_p99_tpot_ms": tpot, "regular_p99_itl_ms": itl}

    ratios = long_prompt_ratios({"baseline": run(4.0, 10.0), "chunked": run(6.0, 20.0),
                                 "unchunked": run(12.0, 15.0)})
    assert ratios == {"chunked_p99_tpot_vs_baseline": 1.5, "chunked_p99_itl_vs_baseline": 2.0,
                      "unchunked_p99_tpot_vs_baseline": 3.0, "unchunked_p99_itl_vs_baseline": 1.5}


def test_flags_checked_and_passed_to_the_local_cluster(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="longer than --input-len"):
        BenchServingConfig(model=tmp_path, compare_long_prompt=True, long_prompt_len=64, input_len=128)
    with pytest.raises(ValueError, match="give --model"):
        BenchServingConfig(url="http://x", compare_long_prompt=True, long_prompt_len=512)
    flags = ["prefill-chunk-tokens=64"]
    config = BenchServingConfig(model=tmp_path, chunked_prefill=False, router_flag=flags)
    assert up_config(config).router_flag == ["prefill-chunk-tokens=64", "chunked-prefill=false"]
