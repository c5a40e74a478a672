"""`--engine-cpus` planning (replica/placement.py) and the replica benchmark's core split."""

from __future__ import annotations

import os
import threading

import pytest

from pdcluster.bench.replica import Cores
from replica.config import ReplicaConfig
from replica.placement import CpuPlacement, PlacementError, set_thread_cpus


def test_engine_cores_are_taken_from_the_allowed_ones() -> None:
    placement = CpuPlacement.plan([3], {0, 1, 2, 3})
    assert placement.engine == {3}
    assert placement.others == {0, 1, 2}
    assert placement.torch_threads(0) == 1  # one intra-op thread per engine core by default
    assert placement.torch_threads(1) == 1
    assert CpuPlacement.plan([2, 3], {0, 1, 2, 3}).torch_threads(0) == 2


def test_engine_on_every_core_leaves_the_others_sharing_them() -> None:
    placement = CpuPlacement.plan([0, 1], {0, 1})
    assert placement.others == {0, 1}


@pytest.mark.parametrize(
    ("engine", "allowed", "threads", "message"),
    [
        ([5], {0, 1}, 0, r"\[5\] not among the cores this process may use \[0, 1\]"),
        ([], {0, 1}, 0, "at least one core"),
        ([1], {0, 1}, 2, "--torch-threads 2 is more than the 1 core"),
    ],
)
def test_refusals_name_the_problem(engine: list[int], allowed: set[int], threads: int, message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        CpuPlacement.plan(engine, allowed, threads)


@pytest.mark.parametrize("cpus", [[-1], [1, 1]])
def test_config_refuses_negative_or_repeated_cores(tmp_path: os.PathLike[str], cpus: list[int]) -> None:
    with pytest.raises(ValueError, match="--engine-cpus must be distinct core numbers"):
        ReplicaConfig(model=tmp_path, port=0, engine_cpus=cpus)  # type: ignore[arg-type]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux-only")
def test_set_thread_cpus_changes_only_the_calling_thread() -> None:
    allowed = os.sched_getaffinity(0)
    one = {min(allowed)}
    seen: dict[str, set[int]] = {}

    def pin() -> None:
        set_thread_cpus(one)
        seen["thread"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=pin)
    thread.start()
    thread.join()
    assert seen["thread"] == one
    assert os.sched_getaffinity(0) == allowed  # this (main) thread kept its cores


def test_bench_cores_split_the_last_core_for_the_engine() -> None:
    cores = Cores.plan(True, {0, 1, 2})
    assert cores is not None
    assert cores.engine == {2} and cores.client == {0, 1}
    assert Cores.plan(True, {0}) is None  # one core: nothing to split
    assert Cores.plan(False, {0, 1}) is None
