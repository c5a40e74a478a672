"""Simulated-GPU cost models against step times computed by hand: the roofline, the profile table,
and the KV pages a GPU's memory leaves."""

from __future__ import annotations

from pathlib import Path

import pytest

from replica.engine.sim.cards import card_dtype, load_card
from replica.engine.sim.cost import Fed, Roofline, kv_bytes_per_token, layer_params
from replica.engine.sim.factory import RUNTIME_RESERVE_BYTES, kv_blocks
from replica.engine.sim.gpus import GpuSpec, gpu
from replica.engine.sim.profile import ProfileCost
from replica.model.layout import ITEMSIZE, WeightLayout

LLAMA7B = load_card("llama-2-7b")
# one Llama-2-7B layer: q,k,v 3·4096², o 4096², gate/up/down 3·4096·11008, two norms 2·4096
LAYER_7B = 3 * 4096 * 4096 + 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096


def test_card_sizes_by_hand() -> None:
    assert layer_params(LLAMA7B) == LAYER_7B == 202_383_360
    assert kv_bytes_per_token(LLAMA7B, 2) == 2 * 32 * 4096 * 2  # K and V, 32 layers, 4096 wide, bf16
    layout = WeightLayout.for_config(LLAMA7B, card_dtype("llama-2-7b"))
    params = 32 * LAYER_7B + 2 * 32000 * 4096 + 4096  # layers, embedding and head, final norm
    assert layout.total_bytes >= params * 2
    assert layout.total_bytes < params * 2 * 1.001  # alignment padding only


def test_roofline_decode_is_memory_bound_by_hand() -> None:
    a100 = gpu("a100-80g")
    cost = Roofline(LLAMA7B, 2, a100, compute_efficiency=1.0, memory_efficiency=1.0)
    step = cost.step([Fed(1, 1023)])  # one sequence, its 1024th token
    bw = 2039e9
    dense = LAYER_7B * 2 / bw  # every weight of the layer read once
    attention = 1024 * 2 * 4096 * 2 / bw  # K and V of 1024 tokens in this layer
    head = 32000 * 4096 * 2 / bw
    embed = 4096 * 2 / bw
    assert step.layer == pytest.approx(dense + attention, rel=1e-12)
    assert step.head == pytest.approx(head, rel=1e-12)
    assert step.embed == pytest.approx(embed, rel=1e-12)
    assert step.total == pytest.approx(embed + 32 * (dense + attention) + head, rel=1e-12)
    assert step.total == pytest.approx(6.75e-3, rel=0.02)  # ≈ 13.5 GB of weights / 2 TB/s


def test_roofline_prefill_is_compute_bound_by_hand() -> None:
    spec = GpuSpec("test", tflops=100.0, mem_gbps=1000.0, memory_gib=80.0)
    cost = Roofline(LLAMA7B, 2, spec, compute_efficiency=0.5, memory_efficiency=0.5)
    step = cost.step([Fed(2048, 0)])
    flops = 50e12
    dense = 2 * LAYER_7B * 2048 / flops
    attention = 4 * 4096 * (2048 * 2049 // 2) / flops  # QK^T and PV over the causal pairs
    head = 2 * 4096 * 32000 / flops  # the last token's logits only
    assert step.layer == pytest.approx(dense + attention, rel=1e-12)
    assert step.head == pytest.approx(max(head, 32000 * 4096 * 2 / 500e9), rel=1e-12)
    assert step.layers(8) == pytest.approx(8 * step.layer)


def test_roofline_batch_of_decodes_shares_the_weights() -> None:
    cost = Roofline(LLAMA7B, 2, gpu("h100-80g"), 0.6, 0.8)
    one = cost.step([Fed(1, 511)]).total
    many = cost.step([Fed(1, 511)] * 32).total
    assert one < many < 3 * one  # the weights are read once per step, only the K/V grow


def _table(tmp_path: Path, rows: str) -> Path:
    path = tmp_path / "profile.csv"
    path.write_text("phase,batch_size,context_len,ms\n" + rows)
    return path


GRID = ("prefill,1,512,20\nprefill,1,1024,40\nprefill,2,512,36\nprefill,2,1024,76\n"
        "decode,1,512,6\ndecode,1,2048,8\ndecode,32,512,10\ndecode,32,2048,18\n")


def test_profile_table_points_interpolation_and_mixed_steps(tmp_path: Path) -> None:
    cost = ProfileCost.load(_table(tmp_path, GRID), num_layers=4)
    assert cost.step([Fed(512, 0)]).total == pytest.approx(20e-3)
    assert cost.step([Fed(1024, 0), Fed(1024, 0)]).total == pytest.approx(76e-3)
    assert cost.step([Fed(768, 0)]).total == pytest.approx(30e-3)  # halfway in context
    # bilinear: batch 1.5 between 1 and 2, context 768 between 512 and 1024
    assert cost.step([Fed(768, 0), Fed(768, 0)]).total == pytest.approx(30e-3 + (56e-3 - 30e-3), rel=1e-9)
    assert cost.step([Fed(1, 2047)]).total == pytest.approx(8e-3)  # decode keyed by the whole context
    assert cost.step([Fed(1, 1279)] * 32).total == pytest.approx(14e-3)
    assert cost.step([Fed(2048, 0)]).total == pytest.approx(80e-3)  # past the edge: the last slope
    both = cost.step([Fed(512, 0), Fed(1, 511)])  # a prefill and a decode in one forward: the sum
    assert both.total == pytest.approx(26e-3)
    assert both.layer == pytest.approx(26e-3 / 4)  # spread evenly over the layers


def test_profile_table_refuses_bad_tables(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="full grid"):
        ProfileCost.load(_table(tmp_path, GRID.replace("prefill,2,1024,76\n", "")), 4)
    with pytest.raises(ValueError, match="no decode rows"):
        ProfileCost.load(_table(tmp_path, "prefill,1,512,20\n"), 4)
    with pytest.raises(ValueError, match=":2: bad row"):
        ProfileCost.load(_table(tmp_path, "warmup,1,512,20\n"), 4)
    with pytest.raises(ValueError, match=":3: need phase"):
        ProfileCost.load(_table(tmp_path, "prefill,1,512,20\ndecode,1,x,3\n"), 4)
    with pytest.raises(ValueError, match="bad row"):
        ProfileCost.load(_table(tmp_path, "prefill,0,512,20\n"), 4)


def test_kv_blocks_are_what_the_memory_leaves_by_hand() -> None:
    a100 = gpu("a100-80g")
    weights = WeightLayout.for_config(LLAMA7B, "bfloat16").total_bytes
    blocks = kv_blocks(a100, 0.9, weights, LLAMA7B, 16, ITEMSIZE["bfloat16"], 4096)
    activations = 4096 * (4 * 4096 + 2 * 11008) * 2
    budget = 80 * 2**30 * 0.9 - weights - RUNTIME_RESERVE_BYTES - activations
    per_block = 32 * 2 * 16 * 4096 * 2  # 16 tokens' K and V in every layer: 8 MiB
    assert blocks == int(budget // per_block)
    assert 100_000 < blocks * 16 < 130_000  # ≈ 60 GB of KV at 0.5 MiB a token
    with pytest.raises(ValueError, match="no KV room"):
        kv_blocks(gpu("l4"), 0.9, 2 * weights, LLAMA7B, 16, 2, 4096)


def test_unknown_gpu_and_card_name_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a100-80g"):
        gpu("tpu-v5")
    with pytest.raises(ValueError, match="llama-2-7b"):
        load_card("gpt-5")
    bad = tmp_path / "card.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a table"):
        load_card(str(bad))
