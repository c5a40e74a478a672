"""`pdcluster up --device cuda --prefill 1 --decode 1` on one GPU: both replicas on it, serving OpenAI
completions equal to the in-process engine on the same device (same dtype, backend and graphs), under
each built-in migration strategy that can run there.

Strategies that send KV between the replicas need a fabric that moves device memory; where `up`'s
replicas logged that theirs cannot (the tcp fabric moves host memory only), those strategies are
skipped with that line. The others (`recompute`, `colocated`, `mutate`) always run. The reference of
`recompute` is what it does: the prompt's first token on one run, then prompt + that token prefilled
again as a continuation (in bfloat16 a re-prefilled token's K/V need not be the decoded one's bits).
One cluster for the module; every page free after each strategy. Skips without a CUDA device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pdcluster.cluster.local import LocalCluster, UpConfig
from replica.config import ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.types import BatchId, BatchSpec, RequestId, RequestSpec, StoppingParams
from router import strategies
from router.tokenizer import Tokenizer
from tests.helpers.cuda_engines import CUDA_REASON, run_to_end
from tests.helpers.router_cluster import replica_infos, wait_pages_free

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)

DEVICE = "cuda"
PROMPTS = (("The quick brown fox", 12), ("Once upon a time there was a tiny model that", 17))
NUM_BLOCKS = 256
SENDS_NO_KV = ("recompute", "colocated", "mutate")
# the ones that send no KV first, mutate (which swaps the replicas' roles) last
ORDER = sorted(strategies.names(), key=lambda n: (n == "mutate", n not in SENDS_NO_KV))


class Reference:
    """The engine in this process on the same device, with the replicas' settings."""

    def __init__(self, model_dir: Path) -> None:
        self.engine: Engine = build_engine(ReplicaConfig(model=model_dir, port=0, num_blocks=NUM_BLOCKS,
                                                         device=DEVICE))
        self.pages = self.engine.blocks.num_free
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self.batches = iter(range(1, 10**6))

    def text(self, prompt: str, max_new: int, recompute: bool) -> str:
        ids = self.tokenizer.encode(prompt)
        tokens = self._recomputed(ids, max_new) if recompute else self._run(ids, max_new)
        return self.tokenizer.decode(tokens)

    def _run(self, ids: list[int], max_new: int, prefix: int = 0) -> list[int]:
        spec = RequestSpec(RequestId(0), tuple(ids), stopping=StoppingParams(max_new_tokens=max_new),
                           generated_prefix=prefix)
        return run_to_end(self.engine, next(self.batches), [spec])[0]

    def _recomputed(self, ids: list[int], max_new: int) -> list[int]:
        """The first token from a prefill, then prompt + it prefilled again as a continuation."""
        batch = BatchId(next(self.batches))
        spec = RequestSpec(RequestId(0), tuple(ids), stopping=StoppingParams(max_new_tokens=max_new))
        result = self.engine.prefill(BatchSpec(batch, (spec,)))
        first = list(result.generations[0].tokens.ids)
        if result.batch is not None:
            self.engine.clear(batch)
        if result.generations[0].generated_text is not None:
            return first
        return first + self._run(ids + first, max_new - len(first), prefix=len(first))


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if "device" not in {f.name for f in dataclasses.fields(UpConfig)}:
        pytest.fail("UpConfig has no `device` field: `pdcluster up --device cuda` is not there yet")
    flags: dict[str, Any] = {"model": model_dir, "prefill": 1, "decode": 1, "strategy": ORDER[0],
                             "http_port": 0, "admin_port": 0, "num_blocks": NUM_BLOCKS, "ready_timeout": 240,
                             "log_dir": tmp_path_factory.mktemp("up-cuda-logs"), "device": DEVICE}
    with LocalCluster(UpConfig(**flags)) as running:
        yield running


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def _set_strategy(admin: str, name: str) -> None:
    import grpc

    from protos import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(admin) as channel:
        stub = router_pb2_grpc.RouterAdminStub(channel)
        stub.SetMigrationStrategy(router_pb2.SetMigrationStrategyRequest(name=name), timeout=30)


def _unmovable(log_dir: Path) -> str:
    """A replica's log line saying its fabric cannot move its device buffers ("" when none)."""
    for log in sorted(log_dir.glob("replica-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "cannot move" in line:
                return line.strip()
    return ""


def test_both_replicas_run_on_the_gpu(cluster: LocalCluster, reference: Reference) -> None:
    infos = replica_infos([p.address for p in cluster.replicas])
    assert [i.device_type for i in infos] == [DEVICE, DEVICE]
    assert {i.dtype for i in infos} == {reference.engine.meta.dtype}


@pytest.mark.parametrize("strategy", ORDER)
def test_completions_equal_the_in_process_engine(cluster: LocalCluster, reference: Reference, model_dir: Path,
                                                 strategy: str) -> None:
    reason = _unmovable(cluster.log_dir)
    if strategy not in SENDS_NO_KV and reason:
        pytest.skip(f"{strategy} sends KV between the replicas, which their fabric cannot here: {reason}")
    _set_strategy(cluster.admin_address, strategy)
    url = cluster.http_url
    for prompt, max_new in PROMPTS:
        want = reference.text(prompt, max_new, recompute=strategy == "recompute")
        body = {"model": model_dir.name, "prompt": prompt, "max_tokens": max_new, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, f"{strategy}: {answer.status_code} {answer.text}"
        done = answer.json()
        assert done["choices"][0]["text"] == want, f"{strategy}, route {done.get('pdcluster_route')}"
    wait_pages_free([p.address for p in cluster.replicas])
    assert reference.engine.blocks.num_free == reference.pages
