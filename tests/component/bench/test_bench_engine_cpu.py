"""`pdcluster bench engine` on the CPU (2-layer tiny model, small batch): pdcluster alone when vLLM's
interpreter is absent, and beside a stand-in peer speaking `vllm_peer.py`'s line protocol (the real
vLLM runs only in the benchmark itself: its own venv, minutes to start). No speed asserted."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from pdcluster.bench.engine import BenchEngineConfig, run
from pdcluster.cli.main import parse

FLAGS = ["--quick", "--batch", "3", "--input-len", "8", "--output-len", "4", "--rounds", "2"]

# answers `ready`, then each `round` with fixed timings: 3 requests x 3 decode tokens over 0.5 s
FAKE_PEER = """#!/bin/sh
echo ready
while read line; do
  [ "$line" = round ] || exit 0
  echo '{"first_s": 0.25, "full_s": 0.75}'
done
"""


def _run(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "engine.json"
    config = parse(["bench", "engine", *FLAGS, *flags, "--json", str(out)])
    assert isinstance(config, BenchEngineConfig)
    assert run(config) == 0
    return json.loads(out.read_text())


def test_without_the_vllm_interpreter_pdcluster_alone_is_measured(tmp_path: Path) -> None:
    data = _run(tmp_path, "--peer", "vllm", "--vllm-python", str(tmp_path / "absent"))
    assert set(data["sides"]) == {"pdcluster"} and "decode_ratio_median" not in data
    rounds = data["sides"]["pdcluster"]["rounds"]
    assert len(rounds) == 2 and all(r["decode_tokens_per_s"] > 0 for r in rounds)


def test_beside_a_peer_every_round_and_the_ratio_are_reported(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PEER)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    data = _run(tmp_path, "--peer", "vllm", "--vllm-python", str(fake))
    vllm = data["sides"]["vllm"]
    assert [r["decode_tokens_per_s"] for r in vllm["rounds"]] == pytest.approx([3 * 3 / 0.5] * 2)
    assert vllm["prefill_tokens_per_s_median"] == pytest.approx(3 * 8 / 0.25)
    ours = data["sides"]["pdcluster"]["decode_tokens_per_s_median"]
    assert data["decode_ratio_median"] == pytest.approx(ours / 18.0)
    assert len(data["decode_ratio_per_round"]) == 2
    assert data["meets_goal"] == (data["decode_ratio_median"] >= data["goal"])


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="output length"):
        BenchEngineConfig(output_len=1)
