"""The soak's faults and operator traffic: admin churn over `router.v1.RouterAdmin`, and one replica
killed (SIGKILL) and restarted with the same rank and port every few minutes.

Admin calls that the router refuses with a precise status (FAILED_PRECONDITION: a replica is busy,
or in a state that cannot drain) are operator errors and counted as such; UNKNOWN or INTERNAL
answers are defects and fail the soak.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from pdcluster.cluster.local import LocalCluster
from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc
from router import strategies

DEFECT_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
CALL_S = 30.0


@dataclass
class Kill:
    """One replica kill: when it died and when its restarted process served again (monotonic s)."""

    rank: int
    killed: float
    back: float | None = None


@dataclass
class ChurnLog:
    """Admin calls by method and status code, and the kills."""

    calls: Counter[str] = field(default_factory=Counter)
    defects: list[str] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)


class Admin:
    """The router's admin service, with its token."""

    def __init__(self, address: str, token: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.RouterAdminStub(self._channel)
        self._metadata = (("x-admin-token", token),) if token else ()

    def replicas(self) -> list[pb.ReplicaStatus]:
        """ListReplicas."""
        return list(self.stub.ListReplicas(pb.ListReplicasRequest(), timeout=CALL_S).replicas)

    def call(self, log: ChurnLog, method: str, request: object) -> object | None:
        """One admin call, counted by its outcome; None when it was refused."""
        try:
            answer = getattr(self.stub, method)(request, timeout=CALL_S, metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            log.calls[f"{method} {code.name}"] += 1
            if code in DEFECT_CODES:
                log.defects.append(f"{method}: {code.name} {exc.details()}")
            return None
        log.calls[f"{method} OK"] += 1
        return answer

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


def _flip(admin: Admin, log: ChurnLog, rng: random.Random) -> None:
    name = rng.choice(strategies.names())
    admin.call(log, "SetMigrationStrategy", pb.SetMigrationStrategyRequest(name=name))
    admin.call(log, "Stats", pb.StatsRequest())


def _drain_and_back(admin: Admin, log: ChurnLog, spare: int, deadline_s: float = 60.0) -> None:
    """Drain one decode replica while another serves, wait until it is idle, give it back its role."""
    decode = [r for r in admin.replicas() if r.role == pb.REPLICA_ROLE_DECODE]
    victims = [r for r in decode if r.rank != spare]
    if len(decode) < 2 or not victims:
        return
    rid = victims[0].id
    if admin.call(log, "Drain", pb.DrainRequest(replica_id=rid)) is None:
        return
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        role = {r.id: r.role for r in admin.replicas()}.get(rid)
        if role in (pb.REPLICA_ROLE_IDLE, pb.REPLICA_ROLE_DEAD):
            break
        time.sleep(0.5)
    else:
        log.defects.append(f"replica {rid} did not drain within {deadline_s:.0f} s")
    admin.call(log, "SetRole", pb.SetRoleRequest(replica_id=rid, role=pb.REPLICA_ROLE_DECODE))


async def admin_loop(admin: Admin, log: ChurnLog, seed: int, until: float, spare: int,
                     flip_every: float = 2.0, drain_every: float = 30.0) -> None:
    """Flip the migration strategy every ~`flip_every` s; every `drain_every` s drain a decode replica
    (not rank `spare`, the one that gets killed) and give it back."""
    rng = random.Random(seed)
    next_drain = time.monotonic() + drain_every / 2
    while time.monotonic() < until:
        await asyncio.to_thread(_flip, admin, log, rng)
        if time.monotonic() >= next_drain:
            await asyncio.to_thread(_drain_and_back, admin, log, spare)
            next_drain = time.monotonic() + drain_every
        await asyncio.sleep(flip_every * (0.5 + rng.random()))


async def kill_loop(cluster: LocalCluster, log: ChurnLog, rank: int, until: float, every: float,
                    down_for: float) -> None:
    """SIGKILL replica `rank` every `every` s, restart it `down_for` s later (same rank and port)."""
    next_kill = time.monotonic() + every / 2
    while True:
        await asyncio.sleep(max(0.0, min(next_kill, until) - time.monotonic()))
        if time.monotonic() >= until:
            return
        proc = cluster.replicas[rank]
        kill = Kill(rank, time.monotonic())
        log.kills.append(kill)
        proc.popen.kill()
        await asyncio.to_thread(proc.popen.wait, 30)
        await asyncio.sleep(down_for)
        proc = cluster.restart_replica(rank)  # on the loop's thread, which outlives the replica
        await asyncio.to_thread(cluster.wait_replica, proc)
        kill.back = time.monotonic()
        next_kill = kill.killed + every
