"""Small parts of the load generator: vLLM's stream chunks, the baseline's prefill batches, the
router's /metrics as resource samples."""

from __future__ import annotations

import json

import pytest

from pdcluster.bench.engine_baseline import prefill_groups
from pdcluster.bench.serving.client import StreamTimer
from pdcluster.bench.serving.stats import RequestRecord
from pdcluster.experiment.sampler import router_samples


def chunk(text: str, finish: str | None, logprob_tokens: list[str] | None = None) -> bytes:
    choice: dict = {"index": 0, "text": text, "finish_reason": finish}
    choice["logprobs"] = None if logprob_tokens is None else {"tokens": logprob_tokens}
    return json.dumps({"id": "x", "object": "text_completion", "choices": [choice]}).encode()


def test_vllm_sends_its_last_token_in_the_chunk_with_the_finish_reason() -> None:
    record = RequestRecord(0, 5)
    timer = StreamTimer(record, sent=0.0)
    timer.event(chunk("a", None, ["a"]), 0.10)
    timer.event(chunk("b", None, ["b"]), 0.15)
    timer.event(chunk("c", "length", ["c"]), 0.25)
    timer.event(b'{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}', 0.26)
    timer.event(b"[DONE]", 0.27)
    assert record.success and record.output_len == 3
    assert record.ttft == 0.10 and record.itl == pytest.approx([0.05, 0.10])


def test_a_one_token_answer_from_vllm_has_a_first_token() -> None:
    record = RequestRecord(0, 5)
    timer = StreamTimer(record, sent=0.0)
    timer.event(chunk("a", "length", ["a"]), 0.2)
    timer.event(b"[DONE]", 0.3)
    assert record.success and record.ttft == 0.2


def test_pdcluster_final_chunk_carries_no_token() -> None:
    record = RequestRecord(0, 5)
    timer = StreamTimer(record, sent=0.0)
    timer.event(b'{"choices":[{"index":0,"logprobs":null,"text":"a","finish_reason":null}]}', 0.1)
    timer.event(chunk("", "length", []), 0.2)
    timer.event(b"[DONE]", 0.2)
    assert record.itl == [] and record.output_len == 1


def test_prefill_batches_follow_the_router_budgets() -> None:
    # the bug: 64 prompts of 128 tokens went to the engine as one 8192-token prefill (limit 4096)
    assert prefill_groups([128] * 64, 4096, 64) == [range(0, 32), range(32, 64)]
    assert prefill_groups([5000, 10, 10], 4096, 64) == [range(0, 1), range(1, 3)]  # a long head alone
    assert prefill_groups([1] * 5, 4096, 2) == [range(0, 2), range(2, 4), range(4, 5)]


def test_router_metrics_become_replica_and_queue_samples() -> None:
    text = """# TYPE pdcluster_replica_state gauge
pdcluster_replica_state{address="a:1",replica="0",role="prefill"} 1.0
pdcluster_replica_state{address="a:1",replica="0",role="decode"} 0.0
pdcluster_replica_state{address="a:2",replica="1",role="decode"} 1.0
# TYPE pdcluster_replica_free_blocks gauge
pdcluster_replica_free_blocks{replica="0"} 500.0
pdcluster_replica_free_blocks{replica="1"} 480.0
# TYPE pdcluster_replica_router_used_blocks gauge
pdcluster_replica_router_used_blocks{replica="1"} 32.0
# TYPE pdcluster_queue_depth gauge
pdcluster_queue_depth 3.0
"""
    assert router_samples(text) == [
        {"kind": "replica", "replica": "0", "role": "prefill", "free_blocks": 500},
        {"kind": "replica", "replica": "1", "role": "decode", "free_blocks": 480, "used_blocks": 32},
        {"kind": "queue", "depth": 3},
    ]
