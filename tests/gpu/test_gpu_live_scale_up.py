"""A live scale-up on GPU replicas (issue 24 part 7): `pdcluster up --device cuda --fabric cuda-ipc
--dtype float32 --prefill 1 --decode 1 --inactive 2 --scaling live`, all on the one GPU.

A burst of greedy completions makes the router scale up by itself: weights go from GPU memory into
the inactive replicas over cuda-ipc (p2p, chain or Tanz) while requests are served, prefilled by a
replica still loading where the load lasts long enough (zigzag); every output equals transformers'
greedy generation in float32 on the same GPU, the cluster comes back to its minimum after the
keep-alive, and every replica's pages are free at the end. Skips without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdcluster.cluster.local import LocalCluster, UpConfig
from tests.cluster.router.test_router_autoscaling_cluster import (
    PLANNER,
    back_to_minimum,
    burst,
    check_tokens,
    finished_loads,
    greedy_reference,
)
from tests.helpers.cuda_engines import CUDA_REASON

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)]


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=4, hidden=128, intermediate=2048)


@pytest.fixture(scope="module")
def reference(model: Path) -> Callable[[list[int]], list[int]]:
    return greedy_reference(model, "cuda")


@pytest.fixture
def cluster(model: Path, tmp_path: Path) -> Iterator[LocalCluster]:
    config = UpConfig(model=model, prefill=1, decode=1, inactive=2, scaling="live", http_port=0, admin_port=0,
                      num_blocks=1024, device="cuda", fabric="cuda-ipc", dtype="float32",
                      router_flag=[*PLANNER, f"timeline={tmp_path / 'timeline.jsonl'}"],
                      log_dir=tmp_path / "logs", ready_timeout=240)
    with LocalCluster(config) as running:
        yield running


def test_live_scale_up_on_gpu_replicas_serves_transformers_tokens(
        cluster: LocalCluster, model: Path, reference: Callable[[list[int]], list[int]], tmp_path: Path
) -> None:
    bodies = burst(cluster, 90, 6.0)
    check_tokens(bodies, model, reference)
    loads = finished_loads(tmp_path / "timeline.jsonl")
    assert loads and all(r["ok"] for r in loads), loads
    assert {r["method"] for r in loads} <= {"p2p", "chain", "tanz"} and any(r["live"] for r in loads)
    back_to_minimum(cluster)
