"""The prefix-cache parts of `bench serving` (pure): figures from the routes, the shared system
prompt, the cache-aware run's ratios, and the local cluster's --routing / --no-prefix-cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.bench.serving.bench import BenchServingConfig, prefix_ratios, up_config
from pdcluster.bench.serving.prompts import PromptMaker, with_prefix
from pdcluster.bench.serving.stats import RequestRecord, prefix_summary, summarize
from pdcluster.bench.serving.workload import conversation_arrivals


def test_prefix_summary_counts_cached_tokens_and_migrated_bytes_of_the_routes() -> None:
    records = [
        RequestRecord(0, input_len=100, success=True, route={"cached_tokens": 64, "migration_bytes": 10}),
        RequestRecord(1, input_len=50, success=True, route={"cached_tokens": 0, "migration_bytes": 30}),
        RequestRecord(2, input_len=30, success=True),  # a server without routes: nothing cached
    ]
    assert prefix_summary(records) == {"cached_prompt_tokens": 64, "prefix_hit_rate": 64 / 180,
                                       "prefill_tokens_computed": 116, "kv_bytes_migrated": 40}
    assert prefix_summary([])["prefix_hit_rate"] == 0.0
    failed = RequestRecord(3, input_len=40, route={"cached_tokens": 40})
    assert summarize([*records, failed], 1.0, {})["cached_prompt_tokens"] == 64  # completed ones only


def test_shared_prefix_replaces_each_prompts_start_and_keeps_lengths() -> None:
    maker = PromptMaker(0, 1000)
    system = maker.system_prompt(8)
    assert system == PromptMaker(0, 1000).system_prompt(8) != PromptMaker(1, 1000).system_prompt(8)
    prompts = with_prefix([list(range(100, 120)), [5, 6, 7]], system)
    assert prompts == [system + list(range(108, 120)), system[:3]]


def test_conversation_turns_repeat_the_conversation_so_far() -> None:
    arrivals = conversation_arrivals(5, 4.0, turns=2, turn_len=10, output_len=3, seed=1)
    assert [(a.input_len, a.hash_ids) for a in arrivals] == [
        (10, (0,)), (10, (2,)), (10, (4,)), (20, (0, 1)), (20, (2, 3))]  # 3 conversations
    assert [a.at for a in arrivals] == sorted(a.at for a in arrivals) and arrivals[-1].at > 0
    maker = PromptMaker(0, 1000, block_tokens=10)
    first, second, other = (maker.prompt(i, arrivals[i]) for i in (0, 3, 1))
    assert len(second) == 20 and second[:10] == first and other[:10] != first
    with pytest.raises(ValueError):
        conversation_arrivals(4, 1.0, turns=0, turn_len=10, output_len=3)
    with pytest.raises(ValueError, match="--conversation-turns"):
        BenchServingConfig(model=Path("m"), conversation_turns=2, trace=Path("t.jsonl"))


def test_prefix_ratios_compare_the_cache_aware_run_with_the_others() -> None:
    def run(computed: int, p50: float, p99: float) -> dict[str, float]:
        return {"prefill_tokens_computed": computed, "median_ttft_ms": p50, "p99_ttft_ms": p99}

    ratios = prefix_ratios({"cache_aware": run(40, 10.0, 50.0), "load": run(80, 15.0, 50.0),
                            "no_prefix_cache": run(100, 30.0, 0.0)})
    assert ratios == pytest.approx({
        "prefill_tokens_saved_vs_load": 0.5, "ttft_p50_speedup_vs_load": 1.5, "ttft_p99_speedup_vs_load": 1.0,
        "prefill_tokens_saved_vs_no_prefix_cache": 0.6, "ttft_p50_speedup_vs_no_prefix_cache": 3.0,
        "ttft_p99_speedup_vs_no_prefix_cache": 0.0})


def test_local_cluster_gets_the_routing_and_the_prefix_cache_flags(tmp_path: Path) -> None:
    config = BenchServingConfig(model=tmp_path, routing="load", prefix_cache=False, pin_decode=False)
    up = up_config(config)
    assert "--no-prefix-cache" in up.replica_args()
    assert up.router_args()[up.router_args().index("--routing") + 1] == "load"
    assert "--no-prefix-cache" not in up_config(BenchServingConfig(model=tmp_path)).replica_args()
    with pytest.raises(ValueError, match="--compare-prefix-cache"):
        BenchServingConfig(url="http://x", compare_prefix_cache=True)
    with pytest.raises(ValueError, match="--shared-prefix-len"):
        BenchServingConfig(model=tmp_path, shared_prefix_len=-1)
