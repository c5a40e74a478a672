"""`pdcluster bench serving --url` against the front end over a fake scheduler: what it sends and records."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.bench.serving.bench import BenchServingConfig, run
from router.http import ServingInfo, create_app
from router.tokenizer import Tokenizer
from tests.helpers.fake_scheduler import FakeScheduler
from tests.helpers.router_http import serve, write_word_tokenizer


def test_bench_client_records_every_token_and_writes_vllm_summary(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(write_word_tokenizer(tmp_path / "tok"))
    scheduler = FakeScheduler(token_delay=0.005, eos_after=1)  # EOS is ignored: exact output lengths
    info = ServingInfo(model_id="fake", max_input_tokens=32, max_total_tokens=48)
    out = tmp_path / "bench" / "serving.json"
    with serve(create_app(scheduler, tokenizer, info, lambda: (b"", "text/plain"))) as url:
        config = BenchServingConfig(
            url=url, num=6, input_len=20, output_len=40, slo=["ttft:60000"], json=out, in_process=False
        )
        assert run(config) == 0
    assert len(scheduler.submitted) == 6
    for request in scheduler.submitted:
        # output clipped to the total budget (48 - 20); greedy; every id a real, non-special token
        assert len(request.input_ids) == 20 and request.stopping.max_new_tokens == 28
        assert request.stopping.ignore_eos and not request.sampling.do_sample
        assert all(3 <= t < tokenizer.vocab_size for t in request.input_ids)
    lines = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(r["success"] and r["output_len"] == 28 for r in lines)
    assert all(len(r["itl"]) == 27 and r["route"]["decode_replica"] == 1 for r in lines)
    summary = json.loads(out.read_text())
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (6, 0, 168)
    assert summary["request_goodput"] == summary["request_throughput"] > 0
    assert summary["p99_itl_ms"] > 0 and summary["median_ttft_ms"] > 0
