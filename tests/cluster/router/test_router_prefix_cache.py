"""Prefix caching through the router, against REAL replica processes on the tiny model.

For every strategy: prompts sharing a long system prompt (several full pages) and the second turn
of a conversation (the first turn's prompt and answer, then more) give transformers' greedy text;
the replicas' prefix caches fill (Info.num_blocks_cached, cached_page_hashes) and afterwards every
page is free or cached again (Info.num_blocks_free == total). Then a decode replica is killed while
streams sharing the system prompt run: they complete on the other one (re-run through the prefill
replica's cache) with transformers' tokens, and the survivors' pages are exact. One cluster
(1 prefill + 2 decode); the kill runs last.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import pytest
from text_generation import AsyncClient as TGIAsyncClient

from pdcluster.cluster.local import LocalCluster, UpConfig
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from router import strategies
from router.config import Strategy
from tests.helpers.router_cluster import GreedyOracle, grpcurl, wait_pages_free

TOKEN = "cluster-test-token"
SYSTEM = "You are a helpful assistant who answers briefly and politely. " * 4


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = UpConfig(model=model_dir, prefill=1, decode=2, strategy=Strategy.FULL.value, http_port=0,
                      admin_port=0, num_blocks=128, admin_token=TOKEN,
                      log_dir=tmp_path_factory.mktemp("up-logs"), ready_timeout=120)
    with LocalCluster(config) as running:
        yield running


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> GreedyOracle:
    return GreedyOracle(model_dir)


@pytest.mark.parametrize("strategy", strategies.names())
def test_shared_prefix_and_second_turn_equal_transformers(
    cluster: LocalCluster, oracle: GreedyOracle, model_dir: Path, strategy: str
) -> None:
    grpcurl(cluster.admin_address, "SetMigrationStrategy", {"name": strategy}, TOKEN)
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", timeout=60)

    def complete(prompt: str, max_new: int) -> str:
        done = client.completions.create(
            model=model_dir.name, prompt=prompt, max_tokens=max_new, temperature=0
        )
        text = done.choices[0].text
        assert text == oracle.text(prompt, max_new), f"{strategy}: {prompt!r}"
        return text

    for question in ("What is a fox?", "Tell me about tiny models.", "Why is the sky blue?"):
        complete(SYSTEM + question, 8)
    turn1 = SYSTEM + "Name a color."
    answer = complete(turn1, 10)
    complete(turn1 + answer + " And another one?", 8)

    addresses = [p.address for p in cluster.replicas]
    wait_pages_free(addresses)  # free or cached: available to the next request
    infos = [_info(a) for a in addresses]
    assert all(i.prefix_cache for i in infos)
    assert any(i.num_blocks_cached > 0 for i in infos)
    for info in infos:
        assert len(info.cached_page_hashes) == info.num_blocks_cached  # nothing held any more


def _info(address: str) -> pb.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.TextGenerationServiceStub(channel).Info(pb.InfoRequest(), timeout=10)


def test_decode_replica_killed_holding_cached_pages(cluster: LocalCluster, oracle: GreedyOracle) -> None:
    grpcurl(cluster.admin_address, "SetMigrationStrategy", {"name": Strategy.FULL.value}, TOKEN)
    prompts = [f"{SYSTEM}Story number {i}:" for i in range(4)]
    max_new = 200  # long enough that the streams still run when the victim is killed
    progress = [0] * len(prompts)

    async def one(client: TGIAsyncClient, index: int, started: asyncio.Event) -> tuple[int, ...]:
        ids = []
        async for response in client.generate_stream(prompts[index], max_new_tokens=max_new, do_sample=False):
            ids.append(response.token.id)
            progress[index] = len(ids)
            if len(ids) >= 3:
                started.set()
        return tuple(ids)

    async def kill_a_busy_decode_replica(tasks: list[asyncio.Task[tuple[int, ...]]]) -> int:
        while not all(t.done() for t in tasks):
            listed = await asyncio.to_thread(grpcurl, cluster.admin_address, "ListReplicas")
            holding = [r for r in listed["replicas"]
                       if r["role"] == "REPLICA_ROLE_DECODE" and int(r.get("requests", 0)) > 0]
            if holding:
                victim = int(max(holding, key=lambda r: int(r.get("requests", 0))).get("id", 0))
                cluster.replicas[victim].popen.kill()
                return victim
            await asyncio.sleep(0.01)
        pytest.fail("every stream ended before a decode replica was seen holding it: nothing was killed")

    async def main() -> tuple[list[tuple[int, ...]], int, list[int]]:
        client = TGIAsyncClient(cluster.http_url, timeout=120)
        started = asyncio.Event()
        tasks = [asyncio.create_task(one(client, i, started)) for i in range(len(prompts))]
        await asyncio.wait_for(started.wait(), 60)
        victim = await kill_a_busy_decode_replica(tasks)
        at_kill = list(progress)
        return list(await asyncio.gather(*tasks)), victim, at_kill

    results, victim, at_kill = asyncio.run(main())
    assert min(at_kill) < max_new, f"every stream had ended when the replica was killed ({at_kill})"
    for prompt, ids in zip(prompts, results, strict=True):
        assert ids == oracle.ids(prompt, max_new)
    survivors = [p.address for i, p in enumerate(cluster.replicas) if i != victim]
    wait_pages_free(survivors)
    for info in (_info(a) for a in survivors):
        assert len(info.cached_page_hashes) == info.num_blocks_cached  # nothing held any more
