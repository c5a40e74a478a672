"""A decode replica killed while idle, then chosen as a migration's receiver before the router knew:
the batch runs again elsewhere and every request succeeds, under `full` and `progressive`.

The receiver's own Immigrate fails at once (UNAVAILABLE: it is marked dead then); the sender stops
trying to connect to its fabric after `CONNECT_GRACE_S` (replica/migration/wire.py) and answers
UNAVAILABLE with the peer cause, and the batch is re-run. A sender that retried until the
migration's deadline instead would fail that request under `progressive` (DEADLINE_EXCEEDED, 502)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pdcluster.cluster.local import LocalCluster, UpConfig
from router.config import Strategy
from tests.helpers.router_cluster import grpcurl, wait_pages_free

TOKEN = "dead-receiver-token"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(params=[Strategy.FULL, Strategy.PROGRESSIVE], ids=lambda s: s.value)
def cluster(request: pytest.FixtureRequest, model_dir: Path, tmp_path: Path) -> Iterator[LocalCluster]:
    config = UpConfig(model=model_dir, prefill=1, decode=2, strategy=request.param, http_port=0, admin_port=0,
                      num_blocks=128, admin_token=TOKEN, log_dir=tmp_path / "logs", ready_timeout=120)
    with LocalCluster(config) as running:
        yield running


def test_requests_succeed_after_their_receiver_was_killed(cluster: LocalCluster, model_dir: Path) -> None:
    victim = cluster.replicas[1]  # the first decode replica: the receiver of the next migration
    victim.popen.kill()
    victim.popen.wait(10)
    for i in range(3):
        body = {"model": model_dir.name, "prompt": f"request {i}", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["pdcluster_route"]["decode_replica"] == 2
    listed = grpcurl(cluster.admin_address, "ListReplicas")["replicas"]
    assert [r.get("role") for r in listed if int(r.get("id", 0)) == 1] == ["REPLICA_ROLE_DEAD"]
    infos = wait_pages_free([cluster.replicas[0].address, cluster.replicas[2].address])
    assert all(i.num_blocks_free == i.num_blocks_total for i in infos)
