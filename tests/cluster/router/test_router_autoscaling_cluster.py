"""Live autoscaling on real replica processes (`pdcluster up --inactive 2 --scaling POLICY`).

A paced burst of greedy completions against 1 prefill + 1 decode replica and two inactive ones
whose weights travel over emulated 0.02 Gbit/s links (about 5 s for the 14 MB checkpoint): the
router scales up by itself, every output equals transformers' greedy generation, the cluster comes
back to its minimum after the keep-alive, and every replica's pages are free at the end. Under
`live`, requests are prefilled by a replica still loading, and batches are relayed to the old
prefill replica. A target killed during a scale-up fails no request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcluster.cluster.local import LocalCluster, UpConfig
from router.scaling.timeline import read
from tests.helpers.eventually import eventually
from tests.helpers.router_cluster import grpcurl, wait_pages_free

MAX_NEW, PROMPT_LEN = 12, 60
PLANNER = ["max-prefill=2", "max-decode=2", "keep-alive=1", "prefill-lower=0.001", "prefill-upper=0.004",
           "decode-lower=0.05", "decode-upper=0.95", "max-batch-prefill-tokens=128"]


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    # wide MLPs: 14 MB of weights (seconds on the emulated links) for little KV per token
    return tiny_model_factory(arch="llama", layers=4, hidden=128, intermediate=2048)


def prompts(n: int) -> list[list[int]]:
    return [[(i * 7 + k) % 300 + 5 for k in range(PROMPT_LEN)] for i in range(n)]


@pytest.fixture(scope="module")
def reference(model: Path) -> Callable[[list[int]], list[int]]:
    return greedy_reference(model)


def greedy_reference(model: Path, device: str = "cpu") -> Callable[[list[int]], list[int]]:
    """transformers' greedy MAX_NEW tokens of a prompt, float32 on `device`, memoised."""
    import torch
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf = hf.to(device).eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            inp = torch.tensor([prompt], device=device)
            with torch.no_grad():
                out = hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=MAX_NEW,
                                  do_sample=False, pad_token_id=0)
            cache[tuple(prompt)] = [int(t) for t in out[0, len(prompt):]]
        return cache[tuple(prompt)]

    return greedy


@pytest.fixture
def up(model: Path, tmp_path: Path) -> Iterator[Callable[[str], LocalCluster]]:
    clusters: list[LocalCluster] = []

    def start(policy: str) -> LocalCluster:
        config = UpConfig(model=model, prefill=1, decode=1, inactive=2, scaling=policy, http_port=0,
                          admin_port=0, num_blocks=1024, link_gbps=0.02, disk_gbps=0.02,
                          router_flag=[*PLANNER, f"timeline={tmp_path / 'timeline.jsonl'}"],
                          log_dir=tmp_path / "logs", ready_timeout=120)
        cluster = LocalCluster(config)
        clusters.append(cluster)
        cluster.start()
        return cluster

    try:
        yield start
    finally:
        for cluster in clusters:
            cluster.stop()


def burst(cluster: LocalCluster, n: int, seconds: float, spike: int = 30) -> list[dict[str, Any]]:
    """`spike` greedy completions at once (the planner's next round sees a queue), then the rest of
    `n` arriving evenly over `seconds`; every answer must be 200."""
    async def one(client: httpx.AsyncClient, i: int, prompt: list[int]) -> dict[str, Any]:
        await asyncio.sleep(max(0, i - spike) * seconds / max(1, n - spike))
        r = await client.post(f"{cluster.http_url}/v1/completions", json={
            "model": cluster.config.model.name, "prompt": [prompt], "max_tokens": MAX_NEW, "temperature": 0})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        body["prompt_ids"] = prompt
        return body

    async def all_of() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=180) as client:
            return list(await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts(n)))))

    return asyncio.run(all_of())


def check_tokens(bodies: list[dict[str, Any]], model: Path, greedy: Callable[[list[int]], list[int]]
                 ) -> None:
    from router.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(model)
    expected = [tokenizer.decode(greedy(body["prompt_ids"])) for body in bodies]
    wrong = [(body["choices"][0]["text"], want, body["pdcluster_route"])
             for body, want in zip(bodies, expected, strict=True) if body["choices"][0]["text"] != want]
    assert not wrong, f"{len(wrong)} of {len(bodies)} differ from transformers: {wrong[:3]}"


def states(admin: str) -> list[str]:
    return [r.get("state", "") for r in grpcurl(admin, "ListReplicas").get("replicas", [])]


def finished_loads(timeline: Path) -> list[dict[str, Any]]:
    """The timeline's transfer records, once every load that started has one (loads outlive a burst)."""
    def done() -> list[dict[str, Any]] | None:
        records = read(timeline)
        plans = [r for r in records if r["kind"] == "plan"]
        started = sum(1 for r in plans for a in r["actions"] if a["action"] == "load")
        transfers = [r for r in records if r["kind"] == "transfer"]
        return transfers if started and len(transfers) == started else None

    return eventually(done, timeout=60, interval=0.5, message="every started load finished")


def back_to_minimum(cluster: LocalCluster) -> None:
    """One prefill and one decode replica serve, the others were reset (after the keep-alive)."""
    def settled() -> list[str] | None:
        now = states(cluster.admin_address)
        ok = sorted(now) == ["decode", "inactive", "inactive", "prefill"]
        return now if ok else None

    eventually(settled, timeout=60, interval=0.5, message="the cluster back at its minimum")
    infos = wait_pages_free([p.address for p in cluster.replicas])
    assert all(i.num_blocks_free == i.num_blocks_total for i in infos), infos


def test_live_scaling_serves_while_loading_and_relays_with_exact_tokens(
        up: Callable[[str], LocalCluster], model: Path, reference: Callable[[list[int]], list[int]],
        tmp_path: Path) -> None:
    cluster = up("live")
    bodies = burst(cluster, 90, 6.0)
    check_tokens(bodies, model, reference)
    routes = [b["pdcluster_route"] for b in bodies]
    loads = finished_loads(tmp_path / "timeline.jsonl")
    records = read(tmp_path / "timeline.jsonl")
    assert all(r["ok"] for r in loads) and {r["method"] for r in loads} <= {"p2p", "chain", "tanz"}
    assert any(r["live"] for r in loads)
    assert any(r["loading_prefill"] for r in routes), "no request was prefilled by a loading replica"
    assert any(r["relay_replica"] is not None for r in routes), "no batch was relayed"
    assert any(r["kind"] == "relay" and r["layer"] >= 1 for r in records), "no batch was split"
    back_to_minimum(cluster)


@pytest.mark.parametrize("policy", ["multicast", "stop-the-world"])
def test_multicast_and_stop_the_world_scale_up_and_back(
        up: Callable[[str], LocalCluster], model: Path, reference: Callable[[list[int]], list[int]],
        tmp_path: Path, policy: str) -> None:
    cluster = up(policy)
    bodies = burst(cluster, 60, 4.0)
    check_tokens(bodies, model, reference)
    loads = finished_loads(tmp_path / "timeline.jsonl")
    methods = {r["method"] for r in loads if r["ok"]}
    assert methods and methods <= ({"load_disk"} if policy == "stop-the-world" else {"p2p", "chain", "tanz"})
    assert not any(r["live"] for r in loads)
    assert not any(b["pdcluster_route"]["loading_prefill"] for b in bodies)
    back_to_minimum(cluster)


def test_a_target_killed_during_a_scale_up_fails_no_request(
        up: Callable[[str], LocalCluster], model: Path, reference: Callable[[list[int]], list[int]],
        tmp_path: Path) -> None:
    cluster = up("multicast")
    timeline = tmp_path / "timeline.jsonl"

    def loading_target() -> int | None:
        for r in read(timeline) if timeline.exists() else []:
            if r["kind"] == "transition" and r["target"] in ("loading_prefill", "loading_decode"):
                return int(r["replica"])
        return None

    async def run() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        requests = loop.run_in_executor(None, burst, cluster, 60, 5.0)
        victim = await loop.run_in_executor(None, lambda: eventually(loading_target, 30, 0.05))
        assert victim is not None
        cluster.replicas[victim].popen.kill()
        return await requests

    bodies = asyncio.run(run())
    check_tokens(bodies, model, reference)
    records = read(timeline)
    failed = [r for r in records if r["kind"] == "transfer" and not r["ok"]]
    assert failed, "the killed target's transfer did not fail"
    dead = {r["replica"] for r in records if r["kind"] == "transition" and r["target"] == "dead"}
    assert dead and dead <= set(failed[0]["targets"])
    # the load comes again: a later round scales up with the surviving target
    check_tokens(burst(cluster, 60, 4.0), model, reference)
    assert any(r["kind"] == "transfer" and r["ok"] for r in read(timeline)), "no later scale-up succeeded"
