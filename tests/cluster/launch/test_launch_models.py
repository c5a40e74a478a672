"""`pdcluster launch --via local` of a cluster file with a `[[models]]` table: two checkpoints of
different shapes side by side, one node with a replica serving the `[model]` and one inactive. The
second model starts at zero; its first request borrows the inactive replica (laid out for its shape,
`--weight-buffer-models` from the file) and both models answer exactly as transformers does."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pdcluster.tools.tiny_model import TinyModelConfig, make_tiny_model
from tests.helpers.launched import Launched, NodeLine, pdcluster, ready_fields, write_cluster_file
from tests.helpers.router_cluster import GreedyOracle

PROMPT = "two models in one file"
MAX_NEW = 8


def complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.mark.long  # a launch and a wake from zero: ~25 s on 2 cores, past the default tier's budget
def test_a_models_table_serves_both_models_like_transformers(tmp_path: Path) -> None:
    root = tmp_path / "models"
    alpha, beta = root / "alpha", root / "beta"
    make_tiny_model(TinyModelConfig(out=alpha, seed=31))
    make_tiny_model(TinyModelConfig(out=beta, seed=32, layers=3, hidden=96, intermediate=192))
    nodes = [NodeLine("a", "127.0.0.1", {"prefill": 1, "inactive": 1}, ("cpu_replicas = 2",))]
    router = ('scaling = "multicast"', "flags = { wake-timeout = 90, min-decode = 0 }")
    file = write_cluster_file(tmp_path / "cluster.toml", alpha, nodes, "local", "127.0.0.1", router=router)
    file.write_text(file.read_text() + f'\n[[models]]\nname = "beta"\npath = "{beta}"\nmin_prefill = 0\n'
                    "min_decode = 0\n")
    launched = Launched(pdcluster("launch", str(file)))
    try:
        url = ready_fields(launched.ready(180))["http"]
        for name, folder in (("beta", beta), ("alpha", alpha)):  # beta first: it is at zero
            answer = complete(url, name)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == GreedyOracle(folder).text(PROMPT, MAX_NEW)
        assert complete(url, "gamma").status_code == 404
    finally:
        launched.kill()
