"""The operator's ActivateReplica by ACTIVATION_METHOD_HOST_PEER, on real replicas in this process:
replicas 0 (prefill) and 1 (decode) serve `alpha` and keep a host copy of `beta`; replicas 2 and 3
registered themselves into `beta`'s pool, inactive, with nothing in host memory. ActivateReplica
loads 2 from the copies the router finds (a share from 0 and from 1) and 3 from the one it names
(1); nothing is read from disk, beta then answers as transformers does on its checkpoint and alpha
still does on its own. Refused first, leaving the targets inactive: a source that is a target
(INVALID_ARGUMENT), a source whose host memory lacks the model (FAILED_PRECONDITION), an unknown
source (NOT_FOUND). A router of one model (no pools) finds the sources among that model's replicas."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from protos import router_pb2 as rpb
from protos import router_pb2_grpc as rpb_grpc
from router.admin import start_admin_server
from router.pools import ModelPools
from router.replicas import State
from router.scheduler import ClusterScheduler
from router.tokenizer import Tokenizer
from tests.component.router.test_router_pools_host_peer import (
    MAX_NEW,
    PROMPT,
    keep_in_host_memory,
    two_models,
)
from tests.helpers.inproc_cluster import InProcReplica, inproc_cluster
from tests.helpers.recording_client import recording_connect
from tests.helpers.router_core import collect, config, greedy, request, run, tokens_of


def _scheduler(model: Path, ids: itertools.count[int], calls: dict[str, list[str]]) -> ClusterScheduler:
    # no heartbeats come from the registered replicas of this test: a long timeout
    cfg = config(model=model, min_prefill=0, min_decode=0, heartbeat_timeout=120.0)
    return ClusterScheduler(cfg, Tokenizer.from_model_dir(model), recording_connect(cfg, calls),
                            kv_bytes_per_token=8, ids=ids)


async def _refused(stub: rpb_grpc.RouterAdminStub, sources: list[int]) -> grpc.aio.AioRpcError:
    ask = rpb.ActivateReplicaRequest(replica_ids=[2], role=rpb.REPLICA_ROLE_PREFILL, source_ids=sources,
                                     method=rpb.ACTIVATION_METHOD_HOST_PEER)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ActivateReplica(ask)
    return refused.value


def test_activate_replicas_from_peers_host_copies(tiny_model_factory: Callable[..., Path],
                                                  tmp_path: Path) -> None:
    alpha, beta, want = two_models(tiny_model_factory)

    def config_for(rank: int) -> dict[str, Any]:
        return {"num_blocks": 64, "inactive": rank >= 2}

    async def body(replicas: list[InProcReplica]) -> None:
        for holder in replicas[:2]:
            keep_in_host_memory(holder, beta.name, alpha.name)
        address = [f"127.0.0.1:{r.services.port}" for r in replicas]
        ids, calls = itertools.count(0), dict[str, list[str]]()
        first, second = _scheduler(alpha, ids, calls), _scheduler(beta, ids, calls)
        await first.add_replica(address[0], State.PREFILL)
        await first.add_replica(address[1], State.DECODE)
        for a in address[2:]:
            await second.add_replica(a, State.INACTIVE, registered=True)
        pools = ModelPools({alpha.name: first, beta.name: second}, [], 30.0, 0.2)
        await pools.start()
        server, port = await start_admin_server(first, "127.0.0.1", 0, pools=pools)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpb_grpc.RouterAdminStub(channel)
                assert (await _refused(stub, [2])).code() == grpc.StatusCode.INVALID_ARGUMENT
                lacking = await _refused(stub, [3])
                assert lacking.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert f"holds no copy of {beta.name}" in str(lacking.details())
                assert (await _refused(stub, [99])).code() == grpc.StatusCode.NOT_FOUND
                assert [h.state.role for h in second.replicas.values()] == [State.INACTIVE] * 2
                assert not any("SendParams" in calls[a] for a in address[:2])

                found = await stub.ActivateReplica(rpb.ActivateReplicaRequest(
                    replica_ids=[2], role=rpb.REPLICA_ROLE_PREFILL, method=rpb.ACTIVATION_METHOD_HOST_PEER))
                assert [(r.id, r.state) for r in found.replicas] == [(2, "prefill")]
                assert [calls[a].count("SendParams") for a in address[:2]] == [1, 1]  # a share each
                named = await stub.ActivateReplica(rpb.ActivateReplicaRequest(
                    replica_ids=[3], role=rpb.REPLICA_ROLE_DECODE, source_ids=[1],
                    method=rpb.ACTIVATION_METHOD_HOST_PEER))
                assert [(r.id, r.state) for r in named.replicas] == [(3, "decode")]
                assert [calls[a].count("SendParams") for a in address[:2]] == [1, 2]
            assert not any("LoadParams" in calls[a] for a in address[2:])
            ask = request(PROMPT, MAX_NEW)
            for model in (beta, alpha):  # the senders still serve their own model
                events = await asyncio.wait_for(collect(pools.front(model.name).submit(ask)), 60)
                assert tokens_of(events) == want[model]
        finally:
            await server.stop(None)
            await pools.stop()

    with inproc_cluster(alpha, tmp_path, 4, config_for) as replicas:
        run(body(replicas))


def test_one_model_router_sends_from_its_own_replicas_host_copies(tiny_model_factory: Callable[..., Path],
                                                                  tmp_path: Path) -> None:
    """Replicas 0 and 1 serve alpha with a host copy of it; the inactive replica 2 loads it from
    theirs and then decodes alone (replica 1 drained): transformers' tokens."""
    alpha = tiny_model_factory(arch="llama", layers=2)
    want = greedy(alpha)(PROMPT, MAX_NEW)

    def config_for(rank: int) -> dict[str, Any]:
        return {"num_blocks": 64, "inactive": rank == 2}

    async def body(replicas: list[InProcReplica]) -> None:
        for holder in replicas[:2]:
            keep_in_host_memory(holder, alpha.name, alpha.name)
        address = [f"127.0.0.1:{r.services.port}" for r in replicas]
        calls = dict[str, list[str]]()
        sched = _scheduler(alpha, itertools.count(0), calls)
        for a, role in zip(address, (State.PREFILL, State.DECODE, State.INACTIVE), strict=True):
            await sched.add_replica(a, role)
        await sched.start()
        for handle in sched.replicas.values():  # their Info now, host copies included
            handle.state.info = await handle.client.info()
        assert [alpha.name in dict(h.state.info.host_copies) for h in sched.replicas.values()] == \
            [True, True, False]
        server, port = await start_admin_server(sched, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpb_grpc.RouterAdminStub(channel)
                await stub.ActivateReplica(rpb.ActivateReplicaRequest(
                    replica_ids=[2], role=rpb.REPLICA_ROLE_DECODE, method=rpb.ACTIVATION_METHOD_HOST_PEER))
                assert [calls[a].count("SendParams") for a in address[:2]] == [1, 1]
                await stub.Drain(rpb.DrainRequest(replica_id=1))
            events = await asyncio.wait_for(collect(sched.submit(request(PROMPT, MAX_NEW))), 60)
            assert tokens_of(events) == want
            assert "DecodeV2" in calls[address[2]] and "LoadParams" not in calls[address[2]]
        finally:
            await server.stop(None)
            await sched.stop()

    with inproc_cluster(alpha, tmp_path, 3, config_for) as replicas:
        run(body(replicas))
