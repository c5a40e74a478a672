"""`pdcluster launch --via local` of a replica whose cluster file says `tp = 2`: its rank 0 serves
with a worker rank beside it (two CPU slices of the node), Info says tp_size 2, the staged rank table
holds one entry per tp_rank, `status` shows the group, and a completion through the router is
transformers' greedy text."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.helpers.launched import Launched, NodeLine, pdcluster, ready_fields, write_cluster_file
from tests.helpers.router_cluster import GreedyOracle, replica_infos

PROMPT, MAX_TOKENS = "hello world", 6


def test_a_tp2_replica_launched_serves_transformers_text(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory()
    nodes = [NodeLine("a", "127.0.0.1", {"colocated": 1}, ("tp = 2",))]
    file = write_cluster_file(tmp_path / "cluster.toml", model, nodes, "local", "127.0.0.1",
                              router=('strategy = "colocated"',))
    launched = Launched(pdcluster("launch", str(file)))
    try:
        fields = ready_fields(launched.ready(180))
        address = fields["replicas"].split("@", 1)[1]
        assert [i.tp_size for i in replica_infos([address])] == [2]
        body = {"model": model.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = httpx.post(f"{fields['http']}/v1/completions", json=body, timeout=60).json()
        record = json.loads((tmp_path / "logs" / "run.json").read_text())
        ranks = json.loads(Path(record["node_dir"], "ranks.json").read_text())["ranks"]
        assert [(r["rank"], r["device"], bool(r["grpc_port"])) for r in ranks] == [(0, "cpu", True),
                                                                                  (1, "cpu", False)]
        status = subprocess.run(pdcluster("status", str(file)), capture_output=True, text=True, timeout=120)
        assert status.returncode == 0 and "cpu/2" in status.stdout, status.stdout
        assert subprocess.run(pdcluster("down", str(file)), timeout=120).returncode == 0
        assert launched.wait(60) == 0
    finally:
        launched.kill()
    assert answer["choices"][0]["text"] == GreedyOracle(model).text(PROMPT, MAX_TOKENS)
