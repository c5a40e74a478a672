"""The serving benchmark's pure parts: metrics named like vLLM's, goodput, workloads and traces."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from pdcluster.bench.serving.bench import BenchServingConfig, placement_of, up_config
from pdcluster.bench.serving.stats import (
    RequestRecord,
    cluster_decode_rate,
    mean_concurrency,
    parse_slos,
    percentile,
    steady_decode_rate,
    summarize,
)
from pdcluster.bench.serving.workload import Arrival, clip, load_trace, poisson_arrivals


def _record(i: int, start: float, ttft: float, latency: float, out: int, ok: bool = True) -> RequestRecord:
    gaps = [(latency - ttft) / (out - 1)] * (out - 1) if out > 1 else []
    return RequestRecord(
        i, input_len=10, output_len=out, success=ok, start=start, ttft=ttft, latency=latency, itl=gaps
    )


def test_summary_uses_vllm_names_and_values() -> None:
    records = [
        _record(0, 0.0, 0.1, 1.1, 11),
        _record(1, 0.5, 0.3, 2.3, 11),
        _record(2, 0.0, 0, 0, 0, ok=False),
    ]
    s = summarize(records, duration=2.0, slos={"ttft": 200.0})
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 20, 22)
    assert (
        s["request_throughput"] == 1.0
        and s["output_throughput"] == 11.0
        and s["total_token_throughput"] == 21.0
    )
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(150.0) and s["p99_tpot_ms"] == pytest.approx(199.0)
    assert s["median_itl_ms"] == pytest.approx(150.0) and s["p90_e2el_ms"] == pytest.approx(2180.0)
    assert s["request_goodput"] == 0.5  # only request 0 has TTFT <= 200 ms
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"{p}_{metric}_ms" for p in ("mean", "median", "std", "p90", "p99")} <= set(s)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0 and percentile([], 90) == 0.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_slo_parsing() -> None:
    assert parse_slos(["ttft:200", "tpot:50", "e2el:3000"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 3000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:x"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_cluster_decode_rate_and_concurrency() -> None:
    records = [_record(0, 0.0, 1.0, 3.0, 21), _record(1, 0.0, 1.0, 5.0, 41)]
    assert cluster_decode_rate(records) == pytest.approx(60 / 4.0)
    assert mean_concurrency(records, 5.0) == pytest.approx(8.0 / 5.0)
    assert cluster_decode_rate([_record(0, 0, 0.1, 0.2, 1)]) == 0.0


def test_steady_decode_rate_counts_only_the_window_where_every_request_is_decoded() -> None:
    # first decoded (second) tokens at 1.125 and 2.125, finishes at 5.0 and 7.0: window (2.125, 5.0]
    records = [_record(0, 0.0, 1.0, 5.0, 33), _record(1, 0.5, 1.5, 6.5, 41)]
    steady = steady_decode_rate(records)
    assert steady.seconds == pytest.approx(2.875)
    # both requests: a token every 0.125 s (exact in binary), 23 of them each in (2.125, 5.0]
    assert steady.tokens == 23 + 23
    assert steady.tokens_per_s == pytest.approx(46 / 2.875)
    assert cluster_decode_rate(records) == pytest.approx(72 / 6.0)  # the whole span counts the ramp
    disjoint = [_record(0, 0.0, 0.1, 1.0, 10), _record(1, 2.0, 0.1, 1.0, 10)]
    assert steady_decode_rate(disjoint).seconds == 0.0 and steady_decode_rate(disjoint).tokens_per_s == 0.0
    assert steady_decode_rate([_record(0, 0, 0.1, 0.2, 1)]).tokens == 0


def test_poisson_arrivals() -> None:
    burst = poisson_arrivals(5, math.inf, 8, 4)
    assert [a.at for a in burst] == [0.0] * 5 and burst[0] == Arrival(0.0, 8, 4)
    paced = poisson_arrivals(2000, 10.0, 8, 4, seed=1)
    assert paced == poisson_arrivals(2000, 10.0, 8, 4, seed=1)
    assert all(b.at >= a.at for a, b in itertools.pairwise(paced))
    assert paced[-1].at / 1999 == pytest.approx(0.1, rel=0.1)


def test_traces_and_clipping(tmp_path: Path) -> None:
    moon = tmp_path / "t.jsonl"
    moon.write_text(
        '{"timestamp": 1000, "input_length": 50, "output_length": 7, "hash_ids": [0]}\n'
        '{"timestamp": 3000, "input_length": 900, "output_length": 500, "hash_ids": [1, 2]}\n'
        '{"timestamp": 4000, "input_length": 1, "output_length": 1, "hash_ids": [3]}\n'
    )
    assert load_trace(moon, 2, speed=2.0) == [Arrival(0.0, 50, 7, (0,)), Arrival(1.0, 900, 500, (1, 2))]
    azure = tmp_path / "t.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8\n"
    )
    (first, second) = load_trace(azure, 5)
    assert first == Arrival(0.0, 4808, 10) and second.at == pytest.approx(0.052)
    assert clip([Arrival(0.0, 4808, 10), Arrival(1.0, 5, 500)], 100, 120) == [
        Arrival(0.0, 100, 10),
        Arrival(1.0, 5, 115),
    ]


def test_config_needs_a_target_and_sane_values() -> None:
    with pytest.raises(ValueError):
        BenchServingConfig()
    with pytest.raises(ValueError):
        BenchServingConfig(url="http://x", rate=0)
    with pytest.raises(ValueError):
        BenchServingConfig(url="http://x", slo=["ttft"])
    assert BenchServingConfig(url="http://x").rate == math.inf


def test_stream_timer_times_compact_and_spaced_token_chunks_alike() -> None:
    """The load generator skips parsing the router's compact token chunks; any other server's
    chunks (here with spaces, and text that quotes the marker) are parsed, with the same result."""
    from pdcluster.bench.serving.client import StreamTimer

    compact = b'{"id":"c","choices":[{"index":0,"logprobs":null,"text":"a","finish_reason":null}]}'
    spaced = (b'{"id": "c", "choices": [{"index": 0, "text": "\\"finish_reason\\":null}]",'
              b' "finish_reason": null}]}')
    final = (b'{"choices":[{"index":0,"text":"","finish_reason":"length"}],'
             b'"pdcluster_route":{"decode_replica":"d"}}')
    usage = b'{"choices":[],"usage":{"completion_tokens":3}}'
    record = RequestRecord(index=0, input_len=4)
    timer = StreamTimer(record, sent=10.0)
    for data, now in ((compact, 10.5), (spaced, 10.75), (compact, 11.0), (final, 11.1), (usage, 11.1)):
        timer.event(data, now)
    timer.event(b"[DONE]", 11.2)
    assert timer.tokens == 3 and record.ttft == pytest.approx(0.5) and record.itl == [0.25, 0.25]
    assert record.route == {"decode_replica": "d"} and record.output_len == 3
    assert record.success and record.latency == pytest.approx(1.2)


def test_a_simulated_local_cluster_gets_the_engine_and_no_pinning(tmp_path: Path) -> None:
    config = BenchServingConfig(model=tmp_path, engine="simulated", gpu="h100-80g", model_card="llama-2-7b",
                                byte_scale="1/512")
    up = up_config(config)
    assert (up.engine, up.gpu, up.model_card, up.byte_scale) == (
        "simulated", "h100-80g", "llama-2-7b", "1/512")
    assert not up.pin_decode and placement_of(config) is None
    assert up.replica_args()[:2] == ["--engine", "simulated"]
    assert up_config(BenchServingConfig(model=tmp_path)).engine == "torch"
    with pytest.raises(ValueError, match="--url"):
        BenchServingConfig(url="http://x", engine="simulated")
    with pytest.raises(ValueError, match="a100-80g"):  # an unknown GPU names the known ones
        BenchServingConfig(model=tmp_path, engine="simulated", gpu="tpu-v9")
