"""A model at zero woken from another replica's host memory over the network (BlitzScale's
cluster-wide pool), on real replicas in this process: replicas 0 (prefill) and 1 (decode) serve
`alpha` and keep a host copy of `beta`; `beta` has no replica, and its first request borrows the
spare replica 2, whose own host memory holds nothing — replicas 0 and 1 each send a share of their
copy of beta (SendParams `host_copy_model`, RecvParams `more_srcs`), nothing is read from disk, and
both models then answer exactly as transformers does on their own checkpoint."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protos import generate_pb2 as pb
from router.pools import ModelPools
from router.replicas import State
from router.scheduler import ClusterScheduler
from router.tokenizer import Tokenizer
from tests.helpers.inproc_cluster import CALL_TIMEOUT, InProcReplica, inproc_cluster
from tests.helpers.recording_client import recording_connect
from tests.helpers.router_core import collect, config, greedy, request, run, tokens_of

MAX_NEW = 6
PROMPT = [5, 17, 42, 9]


def two_models(tiny_model_factory: Callable[..., Path]) -> tuple[Path, Path, dict[Path, list[int]]]:
    """Checkpoints alpha and beta of one shape and other weights, and transformers' greedy tokens of
    `PROMPT` on each (they differ: a replica holding the wrong one is seen)."""
    alpha = tiny_model_factory(arch="llama", layers=2)
    beta = tiny_model_factory(arch="llama", layers=2, seed=23)
    want = {m: greedy(m)(PROMPT, MAX_NEW) for m in (alpha, beta)}
    assert want[alpha] != want[beta]
    return alpha, beta, want


def _scheduler(model: Path, ids: itertools.count[int], calls: dict[str, list[str]],
               **overrides: Any) -> ClusterScheduler:
    cfg = config(model=model, scaling="multicast", **overrides)
    return ClusterScheduler(cfg, Tokenizer.from_model_dir(model), recording_connect(cfg, calls),
                            kv_bytes_per_token=8, ids=ids)


def keep_in_host_memory(replica: InProcReplica, kept: str, serving: str) -> None:
    """The replica serves `serving` again, with host copies of it and of `kept` (loaded from disk)."""
    stub = replica.stub
    for load in [None, kept, None, serving]:
        if load is None:
            stub.ResetStatus(pb.ResetStatusRequest(), timeout=CALL_TIMEOUT)
            continue
        case = pb.LOAD_FROM_DISK if load == kept else pb.LOAD_FROM_HOST_MEM
        stub.LoadParams(pb.LoadParamsRequest(load_case=case, model_name=load), timeout=CALL_TIMEOUT)


def test_a_model_at_zero_wakes_from_a_peers_host_copy(tiny_model_factory: Callable[..., Path],
                                                       tmp_path: Path) -> None:
    alpha, beta, want = two_models(tiny_model_factory)

    def config_for(rank: int) -> dict[str, Any]:
        return {"num_blocks": 64, "inactive": rank == 2}

    async def body(replicas: list[InProcReplica]) -> None:
        for holder in replicas[:2]:
            keep_in_host_memory(holder, beta.name, alpha.name)
        address = [f"127.0.0.1:{r.services.port}" for r in replicas]
        ids, calls = itertools.count(0), dict[str, list[str]]()
        first = _scheduler(alpha, ids, calls)
        second = _scheduler(beta, ids, calls, min_prefill=0, min_decode=0)
        await first.add_replica(address[0], State.PREFILL)
        await first.add_replica(address[1], State.DECODE)
        pools = ModelPools({alpha.name: first, beta.name: second}, [address[2]], 30.0, 0.2)
        await pools.start()
        try:
            ask = request(PROMPT, MAX_NEW)
            events = await asyncio.wait_for(collect(pools.front(beta.name).submit(ask)), 60)
            assert tokens_of(events) == want[beta]
            assert all("SendParams" in calls[a] for a in address[:2])  # a share from each holder
            assert "LoadParams" not in calls[address[2]]
            assert pools.wakes == 1 and [h.state.address for h in second.replicas.values()] == [address[2]]
            events = await asyncio.wait_for(collect(pools.front(alpha.name).submit(ask)), 60)
            assert tokens_of(events) == want[alpha]  # the sender still serves its own model
        finally:
            await pools.stop()

    with inproc_cluster(alpha, tmp_path, 3, config_for) as replicas:
        run(body(replicas))
