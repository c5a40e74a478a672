"""Prefix caching through the router, against REAL replica processes on the tiny model.

For every strategy: prompts sharing a long system prompt (several full pages) and the second turn
of a conversation (the first turn's prompt and answer, then more) give transformers' greedy text;
the replicas' prefix caches fill (Info.num_blocks_cached, cached_page_hashes) and afterwards every
page is free or cached again (Info.num_blocks_free == total). One cluster (1 prefill + 1 decode).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import pytest

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
    config = UpConfig(model=model_dir, prefill=1, decode=1, strategy=Strategy.FULL.value, http_port=0,
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
