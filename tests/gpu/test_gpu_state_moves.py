"""Moving GPU state between replicas on one GPU (issue 24 part 7), over `cuda-ipc` and over staged `tcp`.

One `pdcluster up --device cuda --fabric F --prefill 1 --decode 1 --inactive 3` per fabric, all five
replicas on the one GPU:
- KV migration under `full`, `progressive` and `mutate`: OpenAI completions equal the in-process
  engine on the same device with the replicas' dtype (bfloat16: `up` has no dtype flag; one request
  at a time, so both sides run the same shapes and the moved KV is the only difference);
- weights from GPU memory into inactive replicas through the router's ActivateReplica: p2p into one,
  a chain into two; each then reports every layer loaded and generates, over its own gRPC, the
  reference's tokens.
Skips without CUDA; fails, naming the flag, where `up --fabric cuda-ipc` is not there yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch

from pdcluster.cluster.local import LocalCluster, UpConfig
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from protos import router_pb2, router_pb2_grpc
from replica.config import ReplicaConfig
from replica.engine.engine import Engine
from replica.engine.factory import build_engine
from replica.engine.types import RequestId, RequestSpec, StoppingParams
from router.tokenizer import Tokenizer
from tests.helpers.cuda_engines import CUDA_REASON, run_to_end
from tests.helpers.router_cluster import wait_pages_free
from tests.helpers.weights_cluster import generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)]

DEVICE = "cuda"
FABRICS = ("cuda-ipc", "tcp")
STRATEGIES = ("full", "progressive", "mutate")  # mutate last: it swaps the replicas' roles
PROMPTS = (("The quick brown fox", 12), ("Once upon a time there was a tiny model that", 17))
NUM_BLOCKS, LAYERS, MAX_NEW = 256, 3, 8
CALL_S = 60.0


class Reference:
    """The engine in this process on the same device and dtype as the replicas."""

    def __init__(self, model_dir: Path) -> None:
        self.engine: Engine = build_engine(ReplicaConfig(model=model_dir, port=0, num_blocks=NUM_BLOCKS,
                                                         device=DEVICE))
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self.batches = iter(range(1, 10**6))

    def ids(self, prompt: list[int], max_new: int) -> list[int]:
        spec = RequestSpec(RequestId(0), tuple(prompt), stopping=StoppingParams(max_new_tokens=max_new))
        return run_to_end(self.engine, next(self.batches), [spec])[0]

    def text(self, prompt: str, max_new: int) -> str:
        return self.tokenizer.decode(self.ids(self.tokenizer.encode(prompt), max_new))


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=LAYERS)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def _require_fabric_flag(fabric: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(UpConfig)}
    if "device" not in fields:
        pytest.fail("UpConfig has no `device` field: `pdcluster up --device cuda` is not there yet")
    choices = fields["fabric"].metadata.get("choices", ()) if "fabric" in fields else ()
    if fabric not in choices:
        pytest.fail(f"`pdcluster up --fabric {fabric}` is not there yet (UpConfig.fabric choices: {choices})")


@pytest.fixture(scope="module", params=FABRICS)
def cluster(request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LocalCluster]:
    fabric: str = request.param
    _require_fabric_flag(fabric)
    flags: dict[str, Any] = {"model": model_dir, "prefill": 1, "decode": 1, "inactive": 3,
                             "strategy": STRATEGIES[0], "http_port": 0, "admin_port": 0,
                             "num_blocks": NUM_BLOCKS, "ready_timeout": 240, "device": DEVICE,
                             "fabric": fabric, "log_dir": tmp_path_factory.mktemp(f"gpu-moves-{fabric}")}
    with LocalCluster(UpConfig(**flags)) as running:
        yield running


def _admin(cluster: LocalCluster) -> router_pb2_grpc.RouterAdminStub:
    channel = grpc.insecure_channel(cluster.admin_address)
    return router_pb2_grpc.RouterAdminStub(channel)


def _unmovable(log_dir: Path) -> str:
    """A replica's log line saying its fabric cannot move its device buffers ("" when none)."""
    for log in sorted(log_dir.glob("replica-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "cannot move" in line:
                return line.strip()
    return ""


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kv_migration_serves_the_in_process_engines_tokens(cluster: LocalCluster, reference: Reference,
                                                          model_dir: Path, strategy: str) -> None:
    reason = _unmovable(cluster.log_dir)
    assert not reason, f"fabric {cluster.config.fabric} should move device KV: {reason}"
    _admin(cluster).SetMigrationStrategy(router_pb2.SetMigrationStrategyRequest(name=strategy), timeout=30)
    for prompt, max_new in PROMPTS:
        body = {"model": model_dir.name, "prompt": prompt, "max_tokens": max_new, "temperature": 0}
        answer = httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=CALL_S)
        assert answer.status_code == 200, f"{strategy}: {answer.status_code} {answer.text}"
        done = answer.json()
        assert done["choices"][0]["text"] == reference.text(prompt, max_new), \
            f"{cluster.config.fabric}/{strategy}, route {done.get('pdcluster_route')}"
    wait_pages_free([p.address for p in cluster.replicas])


def _inactive(cluster: LocalCluster) -> list[router_pb2.ReplicaStatus]:
    listed = _admin(cluster).ListReplicas(router_pb2.ListReplicasRequest(), timeout=30)
    return [r for r in listed.replicas if r.state == "inactive"]


def _check_loaded_and_serving(address: str, reference: Reference, batch_id: int) -> None:
    """Every layer loaded, and the reference's greedy tokens over the replica's own gRPC."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest(), timeout=CALL_S)
        assert (info.embed_ready, info.num_layers_loaded, info.lm_head_ready) == (True, LAYERS, True)
        assert stub.Health(pb.HealthRequest(), timeout=CALL_S).state == "serving"
        prompts = [reference.tokenizer.encode(p) for p, _ in PROMPTS]
        got = [generate(stub, batch_id + i, [p], MAX_NEW)[0] for i, p in enumerate(prompts)]
    assert got == [reference.ids(p, MAX_NEW) for p in prompts], address


@pytest.mark.parametrize(("method", "targets"), [(router_pb2.ACTIVATION_METHOD_P2P, 1),
                                                 (router_pb2.ACTIVATION_METHOD_CHAIN, 2)],
                         ids=["p2p", "chain"])
def test_weights_from_gpu_memory_into_inactive_replicas(cluster: LocalCluster, reference: Reference,
                                                        method: router_pb2.ActivationMethod, targets: int
                                                        ) -> None:
    idle = _inactive(cluster)
    assert len(idle) >= targets, f"inactive replicas left: {[r.id for r in idle]}"
    chosen = idle[:targets]
    request = router_pb2.ActivateReplicaRequest(replica_ids=[r.id for r in chosen], method=method)
    done = _admin(cluster).ActivateReplica(request, timeout=120)
    assert sorted(r.id for r in done.replicas) == sorted(r.id for r in chosen)
    assert all(r.state != "inactive" for r in done.replicas), done
    for i, replica in enumerate(chosen):
        _check_loaded_and_serving(replica.address, reference, 10**6 + 100 * i + 10 * targets)
