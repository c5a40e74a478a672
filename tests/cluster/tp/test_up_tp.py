"""`pdcluster up --tp 2 --prefill 0 --decode 1` on the CPU: the router serves completions from a
tensor-parallel replica (two processes, gloo) whose text equals transformers' greedy text, prompts
sharing a prefix included (the group's page table shares cached pages; every rank holds its heads)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from pdcluster.cluster.local import LocalCluster, UpConfig
from tests.helpers.router_cluster import GreedyOracle

SYSTEM = "You are a helpful assistant who answers briefly. " * 3


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="mistral", kv_heads=1, sliding_window=16, seed=41)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = UpConfig(model=model_dir, prefill=0, decode=1, tp=2, device="cpu", http_port=0, admin_port=0,
                      num_blocks=128, log_dir=tmp_path_factory.mktemp("up-tp-logs"), ready_timeout=120)
    with LocalCluster(config) as running:
        yield running


@pytest.mark.long
def test_up_tp2_completions_equal_transformers(cluster: LocalCluster, model_dir: Path) -> None:
    oracle = GreedyOracle(model_dir)
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", timeout=60)
    for question in ("What is a fox?", "Tell me about tiny models.", "Why is the sky blue?"):
        prompt = SYSTEM + question
        done = client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=10, temperature=0)
        assert done.choices[0].text == oracle.text(prompt, 10), prompt
