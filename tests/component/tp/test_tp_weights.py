"""Per-rank weights between `pdcluster replica --tp 2` processes: one chain per tp_rank.

A loaded tp 2 group A (ranks 0-1) multicasts into two inactive tp 2 groups B (2-3) and C (4-5):
RdmaBroadcast with the seeds' lists (src_ranks [0, 1], dst_ranks [2, 3, 4, 5]) runs the chains
0 → 2 → 4 and 1 → 3 → 5 at once, each rank over its own fabric endpoint. Both groups then serve
and generate exactly what transformers generates (a rank whose shard did not arrive holds zeros).
Then B is unloaded and reloads from disk (LoadParams: each rank reads its own slices), and NvlBroadcast
(the blocking chain, lists of the groups' rank 0s only: [0] -> [4]) fills C again. Last, p2p
(SendParams / RecvParams: rank 0 → 2 and 1 → 3) and TanzBroadcast (a lane set per tp_rank).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from protos import generate_pb2 as pb
from tests.helpers.tp_replicas import TIMEOUT, Group, Proc, tp_replicas
from tests.helpers.weights_cluster import generate, prompts_for, reference

pytest.importorskip("transformers")
MAX_NEW = 4


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="qwen2", layers=3, seed=41)


@pytest.fixture(scope="module")
def replicas(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    groups = [Group(0, 2), Group(2, 2, inactive=True), Group(4, 2, inactive=True)]
    with tp_replicas(model, tmp_path_factory.mktemp("tpw"), groups) as procs:
        yield procs


def _all(calls: list[Callable[[], object]]) -> None:
    with ThreadPoolExecutor(len(calls)) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result(timeout=TIMEOUT * 2)


def _state(proc: Proc) -> tuple[str, bool, int, bool]:
    info = proc.stub.Info(pb.InfoRequest(), timeout=TIMEOUT)
    health = proc.stub.Health(pb.HealthRequest(), timeout=TIMEOUT).state
    return health, info.embed_ready, info.num_layers_loaded, info.lm_head_ready


def _check_serves(model: Path, procs: list[Proc], batch_id: int) -> None:
    prompts = prompts_for(256, seed=batch_id)
    want = reference(model, prompts, MAX_NEW)
    for proc in procs:
        assert _state(proc) == ("serving", True, 3, True)
        assert generate(proc.stub, batch_id, prompts, MAX_NEW) == want
        proc.check_all_free()


def test_chain_multicast_into_two_inactive_tp2_groups(model: Path, replicas: list[Proc]) -> None:
    _, b, c = replicas
    assert _state(b) == _state(c) == ("inactive", False, 0, False)
    request = pb.BroadcastRequest(src_ranks=[0, 1], dst_ranks=[2, 3, 4, 5])
    _all([functools.partial(p.stub.RdmaBroadcast, request, timeout=TIMEOUT) for p in replicas])
    _all([functools.partial(p.stub.WaitRdmaDone, pb.WaitRdmaDoneRequest(), timeout=TIMEOUT)
          for p in replicas])
    _check_serves(model, [b, c], 3)


def test_load_from_disk_and_blocking_chain_per_rank(model: Path, replicas: list[Proc]) -> None:
    a, b, c = replicas
    for proc in (b, c):
        proc.stub.ResetStatus(pb.ResetStatusRequest(), timeout=TIMEOUT)
        assert _state(proc)[0] == "inactive"
    b.stub.LoadParams(pb.LoadParamsRequest(load_case=pb.LOAD_FROM_DISK, model_path=str(model)),
                      timeout=TIMEOUT)
    request = pb.BroadcastRequest(src_ranks=[0], dst_ranks=[4])  # the groups' rank 0s: chains 0→4, 1→5
    _all([functools.partial(p.stub.NvlBroadcast, request, timeout=TIMEOUT) for p in (a, c)])
    _check_serves(model, [b, c], 4)


def test_p2p_and_tanz_per_rank(model: Path, replicas: list[Proc]) -> None:
    a, b, c = replicas
    for proc in (b, c):
        proc.stub.ResetStatus(pb.ResetStatusRequest(), timeout=TIMEOUT)
    # p2p A -> B: rank 0 -> 2 and rank 1 -> 3 (the peer's rank 0 names its group)
    _all([lambda: a.stub.SendParams(pb.SendParamsRequest(dst=2), timeout=TIMEOUT),
          lambda: b.stub.RecvParams(pb.RecvParamsRequest(src=0), timeout=TIMEOUT)])
    _all([functools.partial(p.stub.WaitRdmaDone, pb.WaitRdmaDoneRequest(), timeout=TIMEOUT) for p in (a, b)])
    # Tanz from A into C: a lane set per tp_rank ([0] -> [4], [1] -> [5])
    tanz = pb.BroadcastRequest(src_ranks=[0, 1], dst_ranks=[4, 5])
    _all([functools.partial(p.stub.TanzBroadcast, tanz, timeout=TIMEOUT) for p in (a, c)])
    _check_serves(model, [b, c], 5)
