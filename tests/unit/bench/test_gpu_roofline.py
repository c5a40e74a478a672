"""`pdcluster bench gpu`'s arithmetic with known numbers: Llama-2-7B's parameters and bytes, prefill
FLOPs by hand, which cells fit in a device's memory, and the goals' verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.bench import gpu_roofline as rl
from pdcluster.bench.gpu import BenchGpuConfig, goals

BF16 = 2
NORMS_7B = 32 * 2 * 4096 + 4096  # two RMSNorm weights per layer and the final one: not counted


def test_llama_2_7b_has_its_published_parameter_count() -> None:
    assert rl.LLAMA_2_7B.params + NORMS_7B == 6_738_415_616  # Llama-2-7b-hf's parameter count
    assert rl.LLAMA_2_7B.layer_matrix_params == 202_375_168
    assert rl.LLAMA_2_7B.kv_bytes_per_token(BF16) == 512 * 1024


def test_decode_bytes_leave_out_the_embedding_table_unless_tied() -> None:
    weights = rl.decode_weight_bytes(rl.LLAMA_2_7B, BF16)
    assert weights == 2 * (32 * 202_375_168 + 32000 * 4096) == 13_214_154_752
    assert rl.decode_kv_bytes(rl.LLAMA_2_7B, BF16, batch=64, context=1024) == 64 * 1024 * 512 * 1024
    tied = rl.ModelShape(hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10,
                         tied_embeddings=True)
    # q 8x8, k and v 8x4 each, o 8x8, MLP 3 x 8x16; the head is the (shared) embedding table, read once
    assert tied.layer_matrix_params == 64 + 32 + 32 + 64 + 384
    assert tied.params == 576 + 80
    assert rl.decode_weight_bytes(tied, 4) == 4 * (576 + 80)


def test_roofline_time_is_bytes_over_the_copy_bandwidth() -> None:
    seconds = rl.decode_roofline_s(rl.LLAMA_2_7B, BF16, batch=1, context=1024, copy_bytes_per_s=2e12)
    assert seconds == pytest.approx((13_214_154_752 + 1024 * 524_288) / 2e12)
    assert 6.8e-3 < seconds < 6.9e-3


def test_prefill_flops_count_linear_layers_the_last_token_head_and_causal_attention() -> None:
    shape = rl.ModelShape(hidden=8, layers=2, heads=2, kv_heads=2, head_dim=4, intermediate=16, vocab=10)
    # per layer: q, k, v, o 8x8 each (256) + MLP 3 x 8x16 (384) = 640 parameters
    linear = 2 * 3 * 2 * 640
    head = 2 * 8 * 10
    attention = 2 * 2 * 2 * 2 * 4 * (3 * 4 // 2)  # QK^T and PV, 2 layers, 2 heads x 4, 1 + 2 + 3 pairs
    assert rl.prefill_flops(shape, 3) == linear + head + attention == 7680 + 160 + 384
    assert rl.matmul_flops(8192) == 2 * 8192**3


def test_seven_b_at_2k_is_mostly_matmul_flops() -> None:
    flops = rl.prefill_flops(rl.LLAMA_2_7B, 2048)
    attention = 4 * 32 * 4096 * 2048 * 2049 // 2
    assert flops == 2 * 2048 * 32 * 202_375_168 + 2 * 32000 * 4096 + attention
    assert 2.7e13 < flops < 2.8e13 and 0.03 < attention / flops < 0.05


def test_cells_that_do_not_fit_are_skipped_with_the_arithmetic() -> None:
    budget = 65 * rl.GIB  # an 80 GB device after 12.6 GiB of weights and the headroom
    cells = rl.plan_decode(rl.LLAMA_2_7B, BF16, 16, [1, 8, 32, 64], [1024, 4096], budget, 4096)
    assert [(c.context, c.batch, c.fits) for c in cells] == [
        (1024, 1, True), (1024, 8, True), (1024, 32, True), (1024, 64, True),
        (4096, 1, True), (4096, 8, True), (4096, 32, True), (4096, 64, False)]
    skipped = cells[-1]
    assert skipped.pages == 64 * 256 and skipped.kv_cache_bytes == 128 * rl.GIB
    assert skipped.reason == ("KV of 64 x 4096 tokens = 16384 pages x 8388608 B = 128.00 GiB > "
                              "65.00 GiB free for pages")
    assert rl.cache_pages_per_context(cells) == {1024: 64 * 64, 4096: 32 * 256}


def test_contexts_past_the_model_positions_and_caches_past_memory_fit_nothing() -> None:
    cells = rl.plan_decode(rl.TINY, 4, 16, [1, 2], [100, 600], budget_bytes=10**9, max_positions=512)
    assert [c.fits for c in cells] == [True, True, False, False]
    assert cells[2].reason == "context 600 > the model's max_position_embeddings 512"
    assert cells[0].pages == 7 and cells[1].pages == 14  # ceil(100 / 16) pages per sequence
    none_fit = rl.plan_decode(rl.TINY, 4, 16, [1], [100], budget_bytes=0, max_positions=512)
    assert not none_fit[0].fits and rl.cache_pages_per_context(none_fit) == {100: 0}


def test_prefill_fit_counts_pages_and_activations() -> None:
    budget = 4 * rl.GIB
    cells = rl.plan_prefill(rl.LLAMA_2_7B, BF16, 16, [2048, 8192], budget, 16384)
    small, big = cells
    assert small.fits and small.bytes_needed == 128 * 8 * 2**20 + 2048 * 4 * (3 * 11008 + 8 * 4096)
    assert not big.fits and big.reason.startswith("512 pages x 8388608 B + activations 2155872256 B = ")


@pytest.mark.parametrize(("value", "limit", "at_most", "verdict"), [
    (1.2, 1.25, True, rl.Verdict.PASS), (1.3, 1.25, True, rl.Verdict.MISS),
    (0.7, 0.6, False, rl.Verdict.PASS), (0.5, 0.6, False, rl.Verdict.MISS),
    (None, 0.6, False, rl.Verdict.SKIPPED)])
def test_goal_verdicts(value: float | None, limit: float, at_most: bool, verdict: rl.Verdict) -> None:
    goal = rl.Goal(value, limit, at_most)
    assert goal.verdict is verdict
    assert goal.to_json()["op"] == ("<=" if at_most else ">=")


def _decode_row(batch: int, context: int, graphs: float | None, eager: float) -> dict[str, object]:
    return {"batch": batch, "context": context, "status": "measured",
            "graphs": None if graphs is None else {"ratio": graphs}, "eager": {"ratio": eager}}


def test_goals_take_the_graph_path_where_it_ran_and_skip_missing_cells() -> None:
    decode = [_decode_row(1, 1024, 1.2, 3.0), _decode_row(1, 4096, None, 1.4),
              {"batch": 64, "context": 1024, "status": "skipped", "graphs": None, "eager": None}]
    prefill = [{"tokens": 2048, "status": "measured", "ratio": 0.65}]
    out = goals(decode, prefill, [1024, 4096])
    assert out["decode_batch1_ctx1024"] == {"value": 1.2, "limit": 1.25, "op": "<=", "verdict": "pass",
                                            "path": "graphs"}
    assert out["decode_batch1_ctx4096"]["verdict"] == "miss"
    assert out["decode_batch1_ctx4096"]["path"] == "eager"
    assert out["decode_batch64_ctx1024"]["verdict"] == "skipped"
    assert out["prefill_2048"] == {"value": 0.65, "limit": 0.6, "op": ">=", "verdict": "pass"}


def test_config_parses_lists_and_refuses_bad_ones(tmp_path: Path) -> None:
    config = BenchGpuConfig(decode_batches="64,1,8,8", contexts="4096, 1024")
    assert config.batches == [1, 8, 64] and config.context_lengths == [1024, 4096]
    assert config.prefill_lengths == [512, 2048, 8192]
    assert config.plot_path is None
    assert BenchGpuConfig(json=tmp_path / "gpu.json").plot_path == tmp_path / "gpu.png"
    assert BenchGpuConfig(json=tmp_path / "gpu.json", plot=tmp_path / "p.png").plot_path == tmp_path / "p.png"
    with pytest.raises(ValueError, match="--decode-batches must list positive integers"):
        BenchGpuConfig(decode_batches="0,1")
    with pytest.raises(ValueError, match="--steps"):
        BenchGpuConfig(steps=0)
