"""The in-process baseline of `bench serving` prefills as the router would: `--num 64 --input-len 128`
crashed with "8192 prompt tokens > max_batch_prefill_tokens 4096"."""

from __future__ import annotations

from pathlib import Path

from pdcluster.bench.engine_baseline import run_engine_baseline


def test_a_batch_past_the_prefill_budget_is_prefilled_in_router_sized_batches(tiny_llama: Path) -> None:
    result = run_engine_baseline(tiny_llama, batch_size=64, input_len=128, output_len=3, repeats=1, threads=1)
    assert result.decode_tokens == 64 * 2  # every request decoded its 2 tokens after the first
    assert result.decode_steps == 2  # all 64 in one merged decode batch
