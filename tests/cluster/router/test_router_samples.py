"""n > 1, min_tokens, /tokenize and vLLM's model list through REAL replica processes (`pdcluster up`'s
LocalCluster, tiny model, 1 prefill + 1 decode) with the OpenAI SDK (issue 26 parts 4, 5, 9)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdcluster.cluster.local import LocalCluster, UpConfig
from router.config import Strategy
from router.tokenizer import Tokenizer
from tests.helpers.router_cluster import wait_pages_free

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = UpConfig(
        model=model_dir,
        prefill=1,
        decode=1,
        strategy=Strategy.FULL.value,
        http_port=0,
        admin_port=0,
        num_blocks=256,
        log_dir=tmp_path_factory.mktemp("samples-logs"),
        ready_timeout=120,
    )
    with LocalCluster(config) as running:
        yield running


def _client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", timeout=60, max_retries=0)


def test_n_samples_are_seeded_and_reproducible(cluster: LocalCluster) -> None:
    client = _client(cluster)
    model = client.models.list().data[0].id

    def texts(seed: int, n: int = 1) -> list[str]:
        answer = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=n, seed=seed
        )
        assert [c.index for c in answer.choices] == list(range(len(answer.choices)))
        return [c.text for c in answer.choices]

    four = texts(11, 4)
    assert len(four) == 4 and texts(11, 4) == four
    assert len(set(four)) > 1  # four different draws
    assert [texts(11 + i)[0] for i in range(4)] == four  # sample i is the request seeded 11 + i
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=4, seed=11, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == four
    wait_pages_free([r.address for r in cluster.replicas])


def test_min_tokens_holds_back_eos(cluster: LocalCluster, model_dir: Path) -> None:
    client = _client(cluster)
    model = client.models.list().data[0].id
    eos = Tokenizer.from_model_dir(model_dir).eos_token_ids[0]
    eager = {str(eos): 100}  # EOS the greedy choice at every step
    answer = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=eager
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 1
    held = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"min_tokens": 5},
        logit_bias=eager,
    )
    assert (
        held.usage is not None
        and held.usage.completion_tokens == 6
        and held.choices[0].finish_reason == "stop"
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        temperature=0,
        extra_body={"min_tokens": 3},
        logit_bias=eager,
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    wait_pages_free([r.address for r in cluster.replicas])


def test_model_list_and_tokenizer_routes(cluster: LocalCluster, model_dir: Path) -> None:
    model = _client(cluster).models.list().data[0]
    assert model.model_extra is not None and Path(model.model_extra["root"]) == model_dir
    assert model.model_extra["max_model_len"] > 0
    tokenizer = Tokenizer.from_model_dir(model_dir)
    tokens = httpx.post(f"{cluster.http_url}/tokenize", json={"prompt": PROMPT}, timeout=30).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    text = httpx.post(f"{cluster.http_url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
    assert text["prompt"] == tokenizer.decode(tokens["tokens"], skip_special_tokens=False)


def test_the_schemathesis_sampler_regression_is_answered(cluster: LocalCluster) -> None:
    """The request that once failed a replica's batch with a 502 ("probability tensor contains either
    inf, nan or element < 0"): a denormal repetition penalty with a frequency penalty and a bias."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "repetition_penalty": 2.2250738585e-313,
        "frequency_penalty": 0.26,
        "logit_bias": {"000000297": 3.0, "5": -1.0},
        "seed": 3,
    }
    for sampled in (True, False):
        answer = httpx.post(
            f"{cluster.http_url}/v1/chat/completions",
            json={**body, "temperature": 1.0 if sampled else 0},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1
    wait_pages_free([r.address for r in cluster.replicas])


def test_n_samples_share_one_prefill(cluster: LocalCluster) -> None:
    """The n samples reach the prefill replica in one batch, and samples 1.. reuse sample 0's full
    prompt pages there (the replica's in-batch prefix sharing): their routes report those tokens cached."""
    client = _client(cluster)
    model = client.models.list().data[0].id
    prompt = "The fishermen of the little town by the sea went out every morning before dawn " * 2
    routes: dict[int, dict[str, Any]] = {}
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=1.0, n=4, seed=5, stream=True
    ):
        if chunk.model_extra and "pdcluster_route" in chunk.model_extra:
            routes[chunk.choices[0].index] = chunk.model_extra["pdcluster_route"]
    assert sorted(routes) == [0, 1, 2, 3]
    assert routes[0]["cached_tokens"] == 0
    assert all(routes[i]["cached_tokens"] > 0 for i in (1, 2, 3))
    assert len({routes[i]["migration_seconds"] for i in range(4)}) == 1  # one batch, one migration
    wait_pages_free([r.address for r in cluster.replicas])
