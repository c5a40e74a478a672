"""The router's gRPC client of a replica, recording the RPCs it sends (for call-sequence checks
against real replicas, which keep no such list).

    calls: dict[str, list[str]] = {}
    sched = ClusterScheduler(cfg, decoder, recording_connect(cfg, calls))
    ... calls["127.0.0.1:5000"] == ["ClearCache", "PrefillV2", "Migrate", ...]
"""

from __future__ import annotations

from typing import Any, cast

from router.client import ReplicaClient
from router.config import RouterConfig
from router.replica_api import Connect, ReplicaApi

RPC_OF = {
    "info": "Info", "prefill": "PrefillV2", "prefill_chunk": "PrefillChunk", "zag_prefill": "ZagPrefill",
    "relay": "Relay",
    "migrate_partial": "MigratePartial", "immigrate_partial": "ImmigratePartial", "start_decode": "DecodeV2",
    "filter_batch": "FilterBatch", "clear_cache": "ClearCache", "migrate": "Migrate",
    "immigrate": "Immigrate",
    "send_params": "SendParams", "recv_params": "RecvParams", "rdma_broadcast": "RdmaBroadcast",
    "tanz_broadcast": "TanzBroadcast", "load_params": "LoadParams", "wait_rdma_done": "WaitRdmaDone",
    "reset_status": "ResetStatus",
}


class RecordingClient:
    """A `ReplicaApi` that appends each RPC's name to `calls` as it is sent, then sends it."""

    def __init__(self, inner: ReplicaClient, calls: list[str]) -> None:
        self._inner = inner
        self.calls = calls
        self.address = inner.address

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        rpc = RPC_OF.get(name)
        if rpc is None:
            return attr

        def send(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(rpc)
            return attr(*args, **kwargs)

        return send


def recording_connect(cfg: RouterConfig, calls: dict[str, list[str]]) -> Connect:
    """A `Connect` whose clients record into `calls[address]`."""
    def connect(address: str) -> ReplicaApi:
        client = ReplicaClient(address, cfg.rpc_timeout, cfg.transfer_timeout)
        return cast(ReplicaApi, RecordingClient(client, calls.setdefault(address, [])))

    return connect

