"""Self-registration of a replica with a router (`pdcluster replica … --router ADDR`).

A small gRPC client of `router.v1.RouterAdmin`, independent of the engine: a daemon thread
registers this replica's address, then sends heartbeats at the interval the router asked for.
When the router forgets the replica (it was declared dead, or the router restarted) it registers
again; when the router is unreachable it keeps retrying, so start order does not matter.

```
 replica ──RegisterReplica(address, role)──► router   (→ replica_id, interval, timeout)
         ──Heartbeat(replica_id) every interval──►    (known=false → register again)
```
"""

from __future__ import annotations

import logging
import threading

import grpc

from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc

log = logging.getLogger("pdcluster.replica")

ROLES = {
    "": pb.REPLICA_ROLE_UNSPECIFIED, "prefill": pb.REPLICA_ROLE_PREFILL, "decode": pb.REPLICA_ROLE_DECODE,
    "colocated": pb.REPLICA_ROLE_COLOCATED, "inactive": pb.REPLICA_ROLE_INACTIVE,
}


class RouterRegistration:
    """Registers `replica_address` with the router at `router_address` and keeps it alive."""

    def __init__(self, router_address: str, replica_address: str, role: str = "", token: str = "",
                 retry_seconds: float = 0.5, call_timeout: float = 5.0) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose from {sorted(r for r in ROLES if r)}")
        self.router_address = router_address
        self.replica_address = replica_address
        self.role = role
        self.metadata = (("x-admin-token", token),) if token else ()
        self.retry_seconds = retry_seconds
        self.call_timeout = call_timeout
        self.replica_id: int | None = None
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the background thread (returns at once)."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="router-registration")
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop heartbeating (the router then expires this replica)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        with grpc.insecure_channel(self.router_address) as channel:
            stub = pb_grpc.RouterAdminStub(channel)
            interval = self.retry_seconds
            while not self._stop.is_set():
                try:
                    interval = self._tick(stub)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                        log.error("router %s refused registration: wrong admin token", self.router_address)
                        return
                    log.debug("router %s: %s", self.router_address, exc)
                    interval = self.retry_seconds
                self._stop.wait(interval)

    def _tick(self, stub: pb_grpc.RouterAdminStub) -> float:
        """Register when needed, else heartbeat; returns the seconds until the next tick."""
        if self.replica_id is not None:
            beat = stub.Heartbeat(pb.HeartbeatRequest(replica_id=self.replica_id), timeout=self.call_timeout,
                                  metadata=self.metadata)
            if beat.known:
                return self._interval
            log.warning("router %s forgot replica %s: registering again", self.router_address,
                        self.replica_id)
            self.replica_id = None
            self.registered.clear()
        resp = stub.RegisterReplica(
            pb.RegisterReplicaRequest(address=self.replica_address, role=ROLES[self.role]),
            timeout=self.call_timeout, metadata=self.metadata)
        self.replica_id = resp.replica_id
        # Beat well inside the router's deadline so one lost beat does not kill the replica.
        self._interval = min(resp.heartbeat_interval_s, resp.heartbeat_timeout_s / 3)
        self.registered.set()
        log.info("registered with router %s as replica %s", self.router_address, self.replica_id)
        return self._interval

    _interval: float = 1.0
