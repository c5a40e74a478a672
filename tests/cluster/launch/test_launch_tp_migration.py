"""`pdcluster launch --via local` of a tp2 prefill replica and a tp2 decode replica: the launch's rank
table gives each group consecutive ranks (ranks 1.. naming their group), the router names one rank
per tp_rank in Migrate / Immigrate, each rank moves its own KV shard, and the completion is
transformers' greedy text, prefilled on one group and decoded on the other."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.helpers.launched import Launched, NodeLine, pdcluster, ready_fields, write_cluster_file
from tests.helpers.router_cluster import GreedyOracle

pytestmark = [
    pytest.mark.long,  # four rank processes and a router on two cores
]
PROMPT, MAX_TOKENS = "hello world, once more", 8


@pytest.mark.parametrize("strategy", ["full", "progressive"])
def test_a_launched_tp2_pair_migrates_per_rank(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, strategy: str
) -> None:
    model = tiny_model_factory()
    nodes = [NodeLine("a", "127.0.0.1", {"prefill": 1}, ("tp = 2",)),
             NodeLine("b", "127.0.0.2", {"decode": 1}, ("tp = 2",))]
    file = write_cluster_file(tmp_path / "cluster.toml", model, nodes, "local", "127.0.0.1",
                              router=(f'strategy = "{strategy}"',))
    launched = Launched(pdcluster("launch", str(file)))
    try:
        fields = ready_fields(launched.ready(180))
        body = {"model": model.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = httpx.post(f"{fields['http']}/v1/completions", json=body, timeout=60).json()
    finally:
        launched.kill()
    assert "pdcluster_route" in answer, answer
    route = answer["pdcluster_route"]
    assert route["prefill_replica"] != route["decode_replica"], route
    assert answer["choices"][0]["text"] == GreedyOracle(model).text(PROMPT, MAX_TOKENS)
