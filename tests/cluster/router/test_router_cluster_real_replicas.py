"""The router against REAL replica processes (`pdcluster up`'s LocalCluster) on the tiny model:
greedy output equals transformers for every strategy, concurrency, disconnects, grpcurl admin, and
a decode replica killed mid-run. One cluster for the whole module (1 prefill + 2 decode)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from text_generation import AsyncClient as TGIAsyncClient
from text_generation import Client as TGIClient
from tokenizers import Tokenizer

from pdcluster.cluster.local import LocalCluster, UpConfig
from router import strategies
from router.config import Strategy
from tests.helpers.router_cluster import (
    GreedyOracle,
    grpcurl,
    wait_pages_free,
)

TOKEN = "cluster-test-token"
PROMPTS = ("The quick brown fox", "Once upon a time there was a tiny model that")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = UpConfig(model=model_dir, prefill=1, decode=2, strategy=Strategy.FULL.value, http_port=0,
                      admin_port=0, num_blocks=256, admin_token=TOKEN,
                      log_dir=tmp_path_factory.mktemp("up-logs"), ready_timeout=120)
    with LocalCluster(config) as running:
        yield running


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> GreedyOracle:
    return GreedyOracle(model_dir)


def addresses(cluster: LocalCluster) -> list[str]:
    return [p.address for p in cluster.replicas]


def set_strategy(cluster: LocalCluster, strategy: Strategy | str) -> None:
    name = strategy.value if isinstance(strategy, Strategy) else strategy
    grpcurl(cluster.admin_address, "SetMigrationStrategy", {"name": name}, TOKEN)


@pytest.mark.parametrize("strategy", strategies.names())
def test_greedy_output_equals_transformers(cluster: LocalCluster, oracle: GreedyOracle, model_dir: Path,
                                           strategy: str) -> None:
    set_strategy(cluster, strategy)
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", timeout=60)
    tgi = TGIClient(cluster.http_url, timeout=60)
    for i, prompt in enumerate(PROMPTS):
        max_new = 12 + 5 * i
        want = oracle.text(prompt, max_new)
        done = client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=max_new,
                                         temperature=0)
        assert done.choices[0].text == want
        route = (done.model_extra or {})["pdcluster_route"]
        assert route["strategy"] == strategy
        if strategy != Strategy.COLOCATED.value:
            assert route["prefill_replica"] != route["decode_replica"] or strategy == Strategy.MUTATE.value
        streamed = client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=max_new,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
        details = tgi.generate(prompt, max_new_tokens=max_new, do_sample=False).details
        assert details is not None
        assert tuple(t.id for t in details.tokens) == oracle.ids(prompt, max_new)
    infos = wait_pages_free(addresses(cluster))
    assert all(i.num_blocks_free == i.num_blocks_total for i in infos)


def test_seeded_sampling_and_penalties_are_the_same_whatever_the_strategy(cluster: LocalCluster) -> None:
    """`recompute` re-prefills prompt + first token on the decode replica, which must go on with the
    same seeds and count that token for the frequency penalty (the tiny model repeats its first token
    greedily: PROMPTS[1] gives 211, 211, ... without the penalty), as every other strategy does."""
    tgi = TGIClient(cluster.http_url, timeout=60)
    runs = {}
    for strategy in strategies.names():
        set_strategy(cluster, strategy)
        sampled = tgi.generate(PROMPTS[0], max_new_tokens=16, do_sample=True, seed=42, temperature=0.9,
                               top_k=50, frequency_penalty=1.5).details
        penalised = tgi.generate(PROMPTS[1], max_new_tokens=16, frequency_penalty=2.0).details
        assert sampled is not None and penalised is not None
        runs[strategy] = (tuple(t.id for t in sampled.tokens), tuple(t.id for t in penalised.tokens))
    assert len(set(runs.values())) == 1, runs


def test_a_stop_sequence_across_the_first_two_tokens_stops_under_every_strategy(
    cluster: LocalCluster, model_dir: Path
) -> None:
    """The first token comes from the prefill replica, the second from the decode replica (under
    `recompute`, from a re-prefill of prompt + first token): a stop sequence made of the end of the
    one and the start of the other must still end the request there."""
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", timeout=60)
    set_strategy(cluster, Strategy.FULL)
    first = client.completions.create(model=model_dir.name, prompt=PROMPTS[1], max_tokens=2, temperature=0,
                                      logprobs=0)
    assert first.choices[0].logprobs is not None and first.choices[0].logprobs.tokens is not None
    one, two = first.choices[0].logprobs.tokens
    assert one and two, "the tiny model's first two tokens have text"
    stop = one[-1] + two[0]
    for strategy in strategies.names():
        set_strategy(cluster, strategy)
        done = client.completions.create(model=model_dir.name, prompt=PROMPTS[1], max_tokens=12,
                                         temperature=0, stop=[stop])
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and choice.text == one[:-1], strategy
        assert done.usage is not None and done.usage.completion_tokens == 2, strategy


def test_logit_bias_through_the_openai_api(
    cluster: LocalCluster, oracle: GreedyOracle, model_dir: Path
) -> None:
    """+100 forces a token in completions and chat, streamed or not; a key outside the vocabulary
    is a 400 naming `logit_bias`."""
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", timeout=60)
    set_strategy(cluster, Strategy.FULL)
    token = oracle.ids(PROMPTS[0], 3)[2]  # an ordinary text token of this vocabulary
    want = oracle.tokenizer.decode([token] * 4)
    forced = client.completions.create(model=model_dir.name, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={str(token): 100})
    assert forced.choices[0].text == want
    streamed = client.completions.create(model=model_dir.name, prompt=PROMPTS[0], max_tokens=4,
                                         temperature=0.8, seed=1, logit_bias={str(token): 100}, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    chat = client.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logit_bias={str(token): 100})
    assert chat.choices[0].message.content == want
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model_dir.name, prompt=PROMPTS[0], max_tokens=4,
                                  logit_bias={"99999999": 1})
    assert "logit_bias" in str(refused.value)


@pytest.mark.parametrize("strategy", strategies.names())
def test_a_request_done_at_its_first_token_does_not_fail_its_batch(
    cluster: LocalCluster, oracle: GreedyOracle, model_dir: Path, strategy: str
) -> None:
    """Eight requests prefilled together, one of them finished by its first token: the others decode
    on (under `progressive` the batch is no longer on the prefill replica, and pruning it there
    once failed the whole batch with NOT_FOUND)."""
    set_strategy(cluster, strategy)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=60) as client:
            return list(await asyncio.gather(*(
                client.post("/v1/completions", json={"model": model_dir.name, "prompt": PROMPTS[i % 2],
                                                     "max_tokens": 1 if i == 0 else 6, "temperature": 0})
                for i in range(8))))

    for i, response in enumerate(asyncio.run(burst())):
        assert response.status_code == 200, (i, response.text)
        assert response.json()["choices"][0]["text"] == oracle.text(PROMPTS[i % 2], 1 if i == 0 else 6)
    infos = wait_pages_free(addresses(cluster))
    assert all(i.num_blocks_free == i.num_blocks_total for i in infos)


@pytest.mark.parametrize("strategy", strategies.names())
def test_text_is_the_decode_of_the_generated_ids_when_a_token_is_an_incomplete_character(
    cluster: LocalCluster, model_dir: Path, strategy: str
) -> None:
    """Every token forced to one byte of a multi-byte character (logit_bias): each prints as U+FFFD.
    Under `recompute` the first comes from the prefill replica and the rest from a re-prefill whose
    prompt ends with it; the answer used to lack the first U+FFFD."""
    set_strategy(cluster, strategy)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    byte = tokenizer.token_to_id("\u00e2")  # the byte-level symbol of 0xE2, a 3-byte character's lead
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", timeout=60)
    bias = {str(byte): 100}
    want = tokenizer.decode([byte] * 4)
    assert want == "\ufffd" * 4
    done = client.completions.create(model=model_dir.name, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                     logit_bias=bias)
    assert done.choices[0].text == want
    streamed = client.completions.create(model=model_dir.name, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                         logit_bias=bias, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    infos = wait_pages_free(addresses(cluster))
    assert all(i.num_blocks_free == i.num_blocks_total for i in infos)


def test_32_concurrent_streams_of_mixed_lengths_complete(cluster: LocalCluster, model_dir: Path) -> None:
    set_strategy(cluster, Strategy.FULL)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model=model_dir.name, prompt="word " * (1 + (i * 7) % 40), max_tokens=4 + (i * 5) % 30,
            temperature=0, stream=True)
        count, reason = 0, None
        async for chunk in stream:
            if chunk.choices:
                count += 1
                if chunk.choices[0].finish_reason is not None:
                    reason = str(chunk.choices[0].finish_reason)
        return count, reason

    async def main() -> list[tuple[int, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", timeout=120)
        return list(await asyncio.gather(*(one(client, i) for i in range(36))))

    results = asyncio.run(main())
    assert len(results) == 36
    metrics = httpx.get(f"{cluster.http_url}/metrics", timeout=30).text
    ttft = [ln for ln in metrics.splitlines() if ln.startswith("pdcluster_time_to_first_token_seconds_count")]
    assert ttft and float(ttft[0].split()[-1]) >= 36
    assert 'pdcluster_replica_state{address=' in metrics and "pdcluster_queue_depth" in metrics
    assert all(count >= 1 and reason in ("length", "stop") for count, reason in results)
    infos = wait_pages_free(addresses(cluster))
    assert all(i.num_blocks_free == i.num_blocks_total for i in infos)


def test_client_disconnect_mid_stream_frees_pages(cluster: LocalCluster, model_dir: Path) -> None:
    body = {"model": model_dir.name, "prompt": "tell me a long story", "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{cluster.http_url}/v1/completions",
                                                        json=body) as resp:
        assert resp.status_code == 200
        lines = 0
        for line in resp.iter_lines():
            lines += line.startswith("data:")
            if lines >= 3:
                break
    infos = wait_pages_free(addresses(cluster))
    assert [i.num_blocks_free for i in infos] == [i.num_blocks_total for i in infos]


def test_grpcurl_lists_drains_and_restores(cluster: LocalCluster) -> None:
    listed = grpcurl(cluster.admin_address, "ListReplicas")["replicas"]
    assert len(listed) == 3
    decode = next(r for r in listed if r["role"] == "REPLICA_ROLE_DECODE")
    rid = decode.get("id", 0)
    with pytest.raises(RuntimeError, match="PermissionDenied"):
        grpcurl(cluster.admin_address, "Drain", {"replicaId": rid}, "wrong-token")
    grpcurl(cluster.admin_address, "Drain", {"replicaId": rid}, TOKEN)
    role = ""
    for _ in range(100):
        role = next(r for r in grpcurl(cluster.admin_address, "ListReplicas")["replicas"]
                    if r.get("id", 0) == rid)["role"]
        if role == "REPLICA_ROLE_IDLE":
            break
        time.sleep(0.1)
    assert role == "REPLICA_ROLE_IDLE"
    grpcurl(cluster.admin_address, "SetRole", {"replicaId": rid, "role": "REPLICA_ROLE_DECODE"}, TOKEN)
    stats = grpcurl(cluster.admin_address, "Stats")
    assert int(stats.get("requests_finished", 0)) > 0


def test_decode_replica_killed_mid_run_requests_complete_on_another(
        cluster: LocalCluster, oracle: GreedyOracle) -> None:
    """Token ids (TGI stream) are compared: a re-run restarts detokenization, so replacement
    characters of split multi-byte tokens may differ in text across the re-run boundary."""
    set_strategy(cluster, Strategy.FULL)
    prompts = [f"story number {i}:" for i in range(6)]
    max_new = 300  # long enough that the streams are still running when the victim is chosen and killed
    before = int(grpcurl(cluster.admin_address, "Stats").get("requests_requeued", 0))
    progress = [0] * len(prompts)  # tokens each stream has received

    async def one(client: TGIAsyncClient, index: int, first: asyncio.Event) -> tuple[int, ...]:
        ids = []
        async for response in client.generate_stream(prompts[index], max_new_tokens=max_new, do_sample=False):
            ids.append(response.token.id)
            progress[index] = len(ids)
            if len(ids) >= 3:
                first.set()
        return tuple(ids)

    async def kill_a_busy_decode_replica(tasks: list[asyncio.Task[tuple[int, ...]]]) -> int:
        """Kill the decode replica holding the most requests right now (one must hold some)."""
        while not all(t.done() for t in tasks):
            listed = await asyncio.to_thread(grpcurl, cluster.admin_address, "ListReplicas")
            holding = [r for r in listed["replicas"]
                       if r["role"] == "REPLICA_ROLE_DECODE" and int(r.get("requests", 0)) > 0]
            if holding:
                victim = int(max(holding, key=lambda r: int(r.get("requests", 0))).get("id", 0))
                cluster.replicas[victim].popen.kill()
                return victim
        pytest.fail("every stream ended before a decode replica was seen holding it: nothing was killed")

    async def main() -> tuple[list[tuple[int, ...]], int, list[int]]:
        client = TGIAsyncClient(cluster.http_url, timeout=120)
        first = asyncio.Event()
        tasks = [asyncio.create_task(one(client, i, first)) for i in range(len(prompts))]
        await asyncio.wait_for(first.wait(), 60)
        victim = await kill_a_busy_decode_replica(tasks)
        at_kill = list(progress)
        return list(await asyncio.gather(*tasks)), victim, at_kill

    results, victim, at_kill = asyncio.run(main())
    assert min(at_kill) < max_new, f"every stream had ended when the replica was killed ({at_kill})"
    for prompt, ids in zip(prompts, results, strict=True):
        assert ids == oracle.ids(prompt, max_new)
    listed = grpcurl(cluster.admin_address, "ListReplicas")["replicas"]
    assert next(r for r in listed if r.get("id", 0) == victim)["role"] == "REPLICA_ROLE_DEAD"
    assert int(grpcurl(cluster.admin_address, "Stats").get("requests_requeued", 0)) > before
    survivors = [p.address for i, p in enumerate(cluster.replicas) if i != victim]
    infos = wait_pages_free(survivors)
    assert all(i.num_blocks_free == i.num_blocks_total for i in infos)
