"""Two colocated tp2 replicas (`pdcluster up --tp 2`) behind the router; a worker rank of the one
serving the requests is killed mid-run: its step fails UNAVAILABLE (the group is broken), the router
marks that replica dead, re-runs its requests on the other group (token ids equal transformers'), and
keeps it dead; the broken group's rank 0 leaves by itself (exit 1) so that a supervisor would restart
it (`LocalCluster` does not; `tests/cluster/launch/test_up_tp_restart.py` shows `up` doing it)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from text_generation import AsyncClient as TGIAsyncClient

from pdcluster.cluster.local import LocalCluster, UpConfig
from router.client import ReplicaClient
from router.errors import ReplicaUnavailable
from tests.helpers.processes import descendants
from tests.helpers.router_cluster import GreedyOracle, grpcurl

pytestmark = pytest.mark.long  # ~45 s: four tp ranks and a router on two cores; the fake-replica
# version (tests/component/router/test_router_tp_groups.py) runs in the default tier

PROMPTS = [f"story number {i}:" for i in range(4)]
MAX_NEW = 300  # long enough that the streams still run when the victim is chosen and killed


@pytest.fixture
def cluster(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> Iterator[LocalCluster]:
    config = UpConfig(model=tiny_model_factory(), prefill=0, decode=2, tp=2, device="cpu",
                      strategy="colocated", http_port=0, admin_port=0, num_blocks=256,
                      log_dir=tmp_path / "logs", ready_timeout=120)
    with LocalCluster(config) as running:
        yield running


def _worker_of(pid: int) -> int:
    """The `replica.tp.worker` process (rank 1) under replica process `pid`."""
    for child in descendants(pid):
        try:
            if b"replica.tp.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    raise AssertionError(f"replica {pid} has no tensor-parallel worker process")


def _holding(cluster: LocalCluster) -> list[int]:
    listed = grpcurl(cluster.admin_address, "ListReplicas")["replicas"]
    return [int(r.get("id", 0)) for r in listed if int(r.get("requests", 0)) > 0]


def _state(cluster: LocalCluster, rid: int) -> str:
    listed = grpcurl(cluster.admin_address, "ListReplicas")["replicas"]
    return str(next(r for r in listed if int(r.get("id", 0)) == rid)["state"])


async def _health(address: str) -> str:
    client = ReplicaClient(address, timeout=10)
    try:
        return await client.health()
    finally:
        await client.close()


def test_a_killed_rank_breaks_its_group_and_the_requests_rerun_on_the_other(
    cluster: LocalCluster, tiny_model_factory: Callable[..., Path]
) -> None:
    before = int(grpcurl(cluster.admin_address, "Stats").get("requests_requeued", 0))
    progress = [0] * len(PROMPTS)

    async def one(client: TGIAsyncClient, index: int, first: asyncio.Event) -> tuple[int, ...]:
        ids = []
        async for response in client.generate_stream(PROMPTS[index], max_new_tokens=MAX_NEW, do_sample=False):
            ids.append(response.token.id)
            progress[index] = len(ids)
            if len(ids) >= 3:
                first.set()
        return tuple(ids)

    async def kill_a_busy_rank(tasks: list[asyncio.Task[tuple[int, ...]]]) -> int:
        while not all(t.done() for t in tasks):
            holding = await asyncio.to_thread(_holding, cluster)
            if holding:
                os.kill(_worker_of(cluster.replicas[holding[0]].popen.pid), signal.SIGKILL)
                return holding[0]
        pytest.fail("every stream ended before a replica was seen holding it: nothing was killed")

    async def main() -> tuple[list[tuple[int, ...]], int, list[int]]:
        client = TGIAsyncClient(cluster.http_url, timeout=120)
        first = asyncio.Event()
        tasks = [asyncio.create_task(one(client, i, first)) for i in range(len(PROMPTS))]
        await asyncio.wait_for(first.wait(), 60)
        victim = await kill_a_busy_rank(tasks)
        at_kill = list(progress)
        return list(await asyncio.gather(*tasks)), victim, at_kill

    results, victim, at_kill = asyncio.run(main())
    assert min(at_kill) < MAX_NEW, f"every stream had ended when the rank was killed ({at_kill})"
    oracle = GreedyOracle(tiny_model_factory())
    for prompt, ids in zip(PROMPTS, results, strict=True):
        assert ids == oracle.ids(prompt, MAX_NEW)
    assert int(grpcurl(cluster.admin_address, "Stats").get("requests_requeued", 0)) > before
    router_log = (cluster.log_dir / "router.log").read_text()
    assert "UNAVAILABLE" in router_log and "tensor-parallel group" in router_log, router_log[-3000:]
    assert cluster.replicas[victim].popen.wait(timeout=60) == 1  # rank 0 of the broken group left
    with pytest.raises(ReplicaUnavailable):
        asyncio.run(_health(cluster.replicas[victim].address))
    time.sleep(3)  # several heartbeat polls: the router does not take the broken group back
    assert _state(cluster, victim) == "dead"
