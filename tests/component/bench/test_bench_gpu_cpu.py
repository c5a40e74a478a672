"""`pdcluster bench gpu` end to end on the CPU (tiny shape, small cells): every section and field of
the JSON, skipped cells with their arithmetic, the profile table, and the PNG. No speed asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdcluster.bench.gpu import BenchGpuConfig, run
from pdcluster.cli.main import parse
from replica.model.compiled_attention import compiler_missing

FLAGS = ["--device", "cpu", "--shape", "tiny", "--decode-batches", "1,4,64", "--contexts", "64,200",
         "--prefill-tokens", "32,96,2048", "--steps", "2", "--repeats", "1", "--matmul-size", "64",
         "--copy-mib", "4", "--headroom-gib", "0", "--profile"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench-gpu") / "gpu.json"
    config = parse(["bench", "gpu", *FLAGS, "--json", str(out)])
    assert isinstance(config, BenchGpuConfig)
    assert run(config) == 0
    return json.loads(out.read_text()), out


def test_every_section_is_written(report: tuple[dict[str, Any], Path]) -> None:
    data, out = report
    assert set(data) >= {"config", "device", "model", "limits", "formulas", "memory", "decode", "prefill",
                         "goals", "profile", "seconds", "host"}
    assert data["device"]["device"] == "cpu" and data["device"]["attention_backend"] == (
        "torch" if compiler_missing() else "native")
    assert data["device"]["cuda_graphs"].startswith("none captured on cpu")
    assert data["limits"]["copy_bytes_per_s"] > 0 and data["limits"]["matmul_flops_per_s"] > 0
    assert data["limits"]["matmul_dtype"] == "bfloat16" and data["limits"]["matmul_n"] == 64
    assert data["model"]["source"] == "random weights, tiny shape"
    assert data["model"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert "copy bandwidth" in data["formulas"]["decode"] and "tokens + 1" in data["formulas"]["prefill"]
    assert data["config"]["json"] == str(out) and data["config"]["plot"] == str(out.with_suffix(".png"))


def test_decode_cells_carry_timings_and_ratios(report: tuple[dict[str, Any], Path]) -> None:
    rows = report[0]["decode"]
    assert [(r["context"], r["batch"]) for r in rows] == [(64, 1), (64, 4), (64, 64), (200, 1), (200, 4),
                                                          (200, 64)]
    for row in rows:
        assert row["status"] == "measured", row
        assert row["graphs"] is None  # no CUDA graphs on the CPU
        eager = row["eager"]
        assert eager["best_s"] > 0 and eager["median_s"] >= eager["best_s"]
        assert eager["ratio"] == pytest.approx(eager["best_s"] / row["roofline_s"])
        assert row["kv_bytes_read"] == row["batch"] * row["context"] * 256
        assert row["pages"] == row["batch"] * -(-row["context"] // 16)


def test_prefill_cells_and_the_position_limit(report: tuple[dict[str, Any], Path]) -> None:
    rows = {r["tokens"]: r for r in report[0]["prefill"]}
    for tokens in (32, 96):
        row = rows[tokens]
        assert row["status"] == "measured"
        assert row["tokens_per_s"] == pytest.approx(tokens / row["best_s"])
        assert row["ratio"] == pytest.approx(row["flops_per_s"] / report[0]["limits"]["matmul_flops_per_s"])
    assert rows[2048]["status"] == "measured"  # the random model accepts up to max(4096, lengths) positions


def test_goals_and_profile(report: tuple[dict[str, Any], Path]) -> None:
    goals = report[0]["goals"]
    assert set(goals) == {"decode_batch1_ctx64", "decode_batch1_ctx200", "decode_batch64_ctx1024",
                          "prefill_2048"}
    assert goals["decode_batch1_ctx64"]["verdict"] in ("pass", "miss")
    assert goals["decode_batch1_ctx64"]["path"] == "eager"
    assert goals["decode_batch64_ctx1024"]["verdict"] == "skipped"  # 1024 is not among the contexts
    assert goals["prefill_2048"]["verdict"] in ("pass", "miss")
    profile = report[0]["profile"]
    assert profile["batch"] == 1 and profile["graphs"] is None
    assert profile["eager"]["top"] and "Self CPU" in profile["eager"]["table"]


def test_the_png_is_written(report: tuple[dict[str, Any], Path]) -> None:
    png = report[1].with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cells_past_free_memory_are_skipped_not_run(tmp_path: Path) -> None:
    out = tmp_path / "skip.json"
    config = BenchGpuConfig(device="cpu", shape="tiny", dtype="float32", decode_batches="1", contexts="64",
                            prefill_tokens="32", steps=1, repeats=1, matmul_size=32, copy_mib=1,
                            headroom_gib=1e6, json=out, plot=tmp_path / "skip.png")
    assert run(config) == 0
    data = json.loads(out.read_text())
    assert data["decode"][0]["status"] == "skipped" and "GiB free for pages" in data["decode"][0]["reason"]
    assert data["decode"][0]["eager"] is None and data["prefill"][0]["status"] == "skipped"
    assert all(g["verdict"] == "skipped" for g in data["goals"].values())
    assert (tmp_path / "skip.png").is_file()


def test_a_cache_that_cannot_be_made_fails_its_batch_and_the_smaller_ones_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdcluster.bench import gpu_measure

    made = gpu_measure.random_cache

    def tight(config: Any, pages: int, *args: Any) -> Any:
        if pages > 100:  # as a device out of memory would
            raise RuntimeError("CUDA out of memory. Tried to allocate 128.00 GiB")
        return made(config, pages, *args)

    monkeypatch.setattr(gpu_measure, "random_cache", tight)
    out = tmp_path / "tight.json"
    config = BenchGpuConfig(device="cpu", shape="tiny", dtype="float32", decode_batches="1,4,64",
                            contexts="64", prefill_tokens="32", steps=1, repeats=1, matmul_size=32,
                            copy_mib=1, headroom_gib=0, json=out)
    assert run(config) == 0
    rows = {r["batch"]: r for r in json.loads(out.read_text())["decode"]}
    assert rows[64]["status"] == "failed" and "out of memory" in rows[64]["reason"]
    assert rows[1]["status"] == rows[4]["status"] == "measured"
