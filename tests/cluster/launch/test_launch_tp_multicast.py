"""`pdcluster launch --via local`: one tp2 decode replica and two inactive tp2 groups; the router's
ActivateReplica (chain) names every rank of every group, each tp_rank's chain carries its shard, and
the activated groups serve transformers' greedy text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.helpers.launched import Launched, NodeLine, pdcluster, ready_fields, write_cluster_file
from tests.helpers.router_cluster import GreedyOracle, grpcurl

pytestmark = [
    pytest.mark.long,  # six rank processes and a router on two cores
]
PROMPT, MAX_TOKENS = "hello world, once more", 8


def test_a_chain_multicast_into_two_launched_tp2_groups(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory()
    nodes = [NodeLine("a", "127.0.0.1", {"decode": 1}, ("tp = 2",)),
             NodeLine("b", "127.0.0.2", {"inactive": 1}, ("tp = 2",)),
             NodeLine("c", "127.0.0.3", {"inactive": 1}, ("tp = 2",))]
    file = write_cluster_file(tmp_path / "cluster.toml", model, nodes, "local", "127.0.0.1",
                              router=('strategy = "colocated"',))
    launched = Launched(pdcluster("launch", str(file)))
    try:
        fields = ready_fields(launched.ready(180))
        chain = {"replicaIds": [1, 2], "method": "ACTIVATION_METHOD_CHAIN"}
        grpcurl(fields["admin"], "ActivateReplica", chain)
        listed = grpcurl(fields["admin"], "ListReplicas")["replicas"]
        assert [(r.get("tpSize", r.get("tp_size")), r.get("ranks")) for r in listed] == [
            (2, [0, 1]), (2, [2, 3]), (2, [4, 5])]
        grpcurl(fields["admin"], "Drain", {"replicaId": 0})
        body = {"model": model.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = httpx.post(f"{fields['http']}/v1/completions", json=body, timeout=60).json()
    finally:
        launched.kill()
    assert answer["pdcluster_route"]["decode_replica"] in (1, 2), answer
    assert answer["choices"][0]["text"] == GreedyOracle(model).text(PROMPT, MAX_TOKENS)
