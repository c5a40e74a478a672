"""Per-rank moves between tensor-parallel groups over a device fabric: every rank's endpoint (rank
0's and the workers') is on the replicas' `--fabric`, on its own device, registering its own buffers.

nccl: A = tp2 ranks 0-1 on cuda:0-1 (loaded), B = tp2 ranks 2-3 on cuda:1-2 (loaded), C = tp2 ranks
4-5 on cuda:1-2 (inactive), meeting through the rank table's store; three CUDA devices (the two
ranks of a pair must sit on different devices to share an NCCL communicator). cuda-ipc: every group
on cuda:0-1 (two devices). Migration A → B (Migrate ‖ Immigrate, shard r from rank r to rank 2 + r),
then B decodes transformers' tokens; a chain multicast A → C (RdmaBroadcast, chains 0 → 4 and
1 → 5), then C serves transformers' tokens. Each fabric skips without its devices or library.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from protos import generate_pb2 as pb
from tests.helpers.migration_cluster import decode_to_end, first_tokens, make_batch, pair, random_prompts
from tests.helpers.migration_cluster import reference as migration_reference
from tests.helpers.tp_replicas import TIMEOUT, Fabric, Group, Proc, tp_replicas
from tests.helpers.weights_cluster import generate, prompts_for
from tests.helpers.weights_cluster import reference as weights_reference
from transfer.fabric import importable
from transfer.store import serve_store

CASES = {  # fabric -> (CUDA devices needed, rank 0 devices of A, B, C)
    "nccl": (3, ("cuda:0", "cuda:1", "cuda:1")),
    "cuda-ipc": (2, ("cuda:0", "cuda:0", "cuda:0")),
}
pytestmark = pytest.mark.gpu


def _skip_reason(fabric: str) -> str:
    needed = CASES[fabric][0]
    if torch.cuda.device_count() < needed:
        return f"per-rank {fabric} moves between tp2 groups need {needed} CUDA devices"
    if fabric == "nccl" and not importable("cupy"):
        return "the nccl fabric needs cupy (pip install pdcluster[gpu-cu12])"
    return ""


LENGTHS = [1, 7, 9, 17]
MAX_NEW = [4, 3, 5, 2]


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", kv_heads=2, seed=51)


@pytest.fixture(scope="module", params=sorted(CASES))
def replicas(model: Path, tmp_path_factory: pytest.TempPathFactory,
             request: pytest.FixtureRequest) -> Iterator[tuple[str, list[Proc]]]:
    fabric = str(request.param)
    if why := _skip_reason(fabric):
        pytest.skip(why)
    store, address = serve_store()  # cuda-ipc needs none; a store does no harm there
    a, b, c = CASES[fabric][1]
    groups = [Group(0, 2, device=a), Group(2, 2, device=b), Group(4, 2, inactive=True, device=c)]
    try:
        with tp_replicas(model, tmp_path_factory.mktemp("tpdev"), groups, Fabric(fabric, address)) as procs:
            yield fabric, procs
    finally:
        del store


def test_every_group_reports_the_fabric(replicas: tuple[str, list[Proc]]) -> None:
    fabric, procs = replicas
    for proc in procs:
        info = proc.stub.Info(pb.InfoRequest(), timeout=TIMEOUT)
        assert (info.tp_size, info.fabric) == (2, fabric)


def test_tp2_to_tp2_migration(model: Path, replicas: tuple[str, list[Proc]]) -> None:
    a, b, _ = replicas[1]
    prompts = random_prompts(256, LENGTHS, seed=11)
    batch = make_batch(1, prompts, MAX_NEW)
    first = a.stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=TIMEOUT)
    _, got = pair(
        lambda: a.stub.Migrate(pb.MigrateRequest(batch=batch, src=[0], dst=[2]), timeout=TIMEOUT),
        lambda: b.stub.Immigrate(pb.ImmigrateRequest(batch=batch, src=[0], dst=[2, 3]), timeout=TIMEOUT),
    )
    tokens = first_tokens(first.generations)
    last = [tokens[r][0] for r in got.batch.request_ids]
    decoded = decode_to_end(cast(Any, b), got.batch, tokens, last)
    assert [decoded[i] for i in range(len(prompts))] == migration_reference(model, prompts, MAX_NEW)
    for proc in (a, b):
        proc.check_all_free()


def test_chain_multicast_into_an_inactive_tp2_group(model: Path, replicas: tuple[str, list[Proc]]) -> None:
    a, _, c = replicas[1]
    request = pb.BroadcastRequest(src_ranks=[0, 1], dst_ranks=[4, 5])
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(functools.partial(p.stub.RdmaBroadcast, request, timeout=TIMEOUT))
                       for p in (a, c)]:
            future.result(timeout=TIMEOUT * 2)
    for proc in (a, c):
        proc.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=TIMEOUT)
    prompts = prompts_for(256, seed=7)
    assert c.stub.Health(pb.HealthRequest(), timeout=TIMEOUT).state == "serving"
    assert generate(c.stub, 3, prompts, 4) == weights_reference(model, prompts, 4)
