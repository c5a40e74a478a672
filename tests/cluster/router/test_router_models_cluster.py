"""Two models in one cluster (`pdcluster up --models`), on real replica processes.

Two tiny checkpoints of different shapes (layers, hidden size) sit side by side; the cluster starts
with one replica serving `alpha` and one inactive replica started with alpha too, its weight buffer
sized for the larger (`up` passes `--weight-buffer-models`). `beta` starts at zero: its first
request waits while the router lends it the shared inactive replica and loads beta into it from the
model root (the replica switches to beta's shape); then both models answer exactly as transformers
does on their own checkpoint, and an unknown model is a 404. Idle, beta's planner (min 0 replicas)
drains its replica, the keep-alive expires and the replica goes back to the shared pool; beta's next
request wakes it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdcluster.cluster.local import LocalCluster, UpConfig
from pdcluster.tools.tiny_model import TinyModelConfig, make_tiny_model
from tests.helpers.eventually import eventually
from tests.helpers.router_cluster import GreedyOracle

PROMPTS = ["the quick brown fox", "a model at zero wakes"]
MAX_NEW = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")  # the replicas' model root: both folders in it
    folders = {"alpha": root / "alpha", "beta": root / "beta"}
    make_tiny_model(TinyModelConfig(out=folders["alpha"], seed=11))
    make_tiny_model(TinyModelConfig(out=folders["beta"], seed=12, layers=3, hidden=96, intermediate=192))
    return folders


@pytest.fixture(scope="module")
def cluster(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    beta = f"beta={models['beta']},min-prefill=0,min-decode=0,keep-alive=0.5"
    config = UpConfig(model=models["alpha"], models=[beta], prefill=1, decode=0, inactive=1, http_port=0,
                      admin_port=0, num_blocks=256, scaling="multicast",
                      router_flag=["wake-timeout=60", "min-decode=0"],
                      log_dir=tmp_path_factory.mktemp("up-logs"), ready_timeout=120)
    with LocalCluster(config) as running:
        yield running


def complete(url: str, model: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=90,
                      json={"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0})


def test_a_model_at_zero_wakes_on_its_first_request_and_both_equal_transformers(
        cluster: LocalCluster, models: dict[str, Path]) -> None:
    listed = httpx.get(f"{cluster.http_url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == ["alpha", "beta"]
    oracles = {name: GreedyOracle(folder) for name, folder in models.items()}
    for name in ("beta", "alpha"):  # beta first: it has no replica yet
        for prompt in PROMPTS:
            answer = complete(cluster.http_url, name, prompt)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == name
            assert answer.json()["choices"][0]["text"] == oracles[name].text(prompt, MAX_NEW)
    # different checkpoints: the equalities above would not hold for the other model's weights
    assert any(oracles["alpha"].ids(p, MAX_NEW) != oracles["beta"].ids(p, MAX_NEW) for p in PROMPTS)
    log = (cluster.log_dir / "router.log").read_text()
    assert "model beta has no serving replica: Load(method=<Method.LOAD_HOST" in log  # woken from zero
    assert "model beta: spare replica" in log  # the shared inactive replica was lent to beta
    replicas = "".join(p.read_text() for p in cluster.log_dir.glob("*.log") if p.name != "router.log")
    assert "switched to beta: 3 layers" in replicas  # the spare, started as alpha, took beta's shape
    unknown = complete(cluster.http_url, "gamma", PROMPTS[0])
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_an_idle_model_goes_back_to_zero_and_wakes_again(cluster: LocalCluster,
                                                         models: dict[str, Path]) -> None:
    oracle = GreedyOracle(models["beta"])
    first = complete(cluster.http_url, "beta", PROMPTS[0])
    assert first.status_code == 200
    log = cluster.log_dir / "router.log"
    # beta's planner drains its replica (min 0), the keep-alive expires, the replica is shared again
    eventually(lambda: "back to the shared pool" in log.read_text(), 60, message="beta at zero")
    again = complete(cluster.http_url, "beta", PROMPTS[1])
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == oracle.text(PROMPTS[1], MAX_NEW)
    assert log.read_text().count("model beta has no serving replica") >= 2
