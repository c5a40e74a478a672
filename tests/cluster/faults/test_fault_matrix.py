"""The fault matrix through the router: one local cluster (1 prefill + 2 decode replicas, each its own
node behind an emulated 4 Mbit/s NIC, so a batch's KV takes seconds on the wire) shared by every
case; each case puts the cluster back (restarts what it killed, same rank and port) before the next.

Each case asserts: no request waits past its deadline, every request finished or failed with a
clear status (an HTTP 5xx or an error event), and no KV page is left on a surviving replica (then
on every replica, once the victim is back).

The matrix (here, and where the replica-level half of a case lives):
- receiver dies mid-migration: `test_receiver_killed_mid_migration`; replica level:
  tests/cluster/migration/test_migration_kills.py
- sender dies mid-migration: `test_sender_killed_mid_migration`; replica level: the same file
- replica restarts with the same rank: every case's heal, and
  `test_replica_restarted_with_its_rank_serves_again`
- a peer that stalls without closing (SIGSTOP): `test_receiver_stalled_mid_migration`
- router dies mid-stream and restarts: `test_router_killed_mid_stream_then_restarted`
- chain member dies mid-multicast (weights): tests/cluster/params/test_multicast_member_killed.py
  and tests/cluster/transfer/test_transfer_subprocess_faults.py (replica and fabric level)
- a decode replica dies while idle or mid-run: tests/cluster/router/test_router_dead_receiver.py,
  tests/cluster/router/test_router_cluster_real_replicas.py
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdcluster.cluster.local import LocalCluster, UpConfig
from protos import router_pb2 as pb
from tests.helpers.fault_matrix import Admin, Flight, descendants, heal, pages_back, wait_for

# The slow tier (`make test-long`, run by CI): the whole matrix takes about a minute on 2 cores.
pytestmark = pytest.mark.long

TOKEN = "faults-token"
HEARTBEAT_TIMEOUT = 3.0
TRANSFER_TIMEOUT = 20.0
DEADLINE = 90.0  # a request: its prefill, a failed migration (transfer timeout), a re-run


@pytest.fixture(scope="module")
def cluster(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LocalCluster]:
    flags = [f"heartbeat-timeout={HEARTBEAT_TIMEOUT}", f"transfer-timeout={TRANSFER_TIMEOUT}",
             "rpc-timeout=30", "max-inbound-migrations=1"]
    config = UpConfig(model=tiny_model_factory(), prefill=1, decode=2, http_port=0, admin_port=0,
                      num_blocks=256, admin_token=TOKEN, log_dir=tmp_path_factory.mktemp("fault-logs"),
                      ready_timeout=120, link_gbps=0.004, router_flag=flags)
    with LocalCluster(config) as running:
        yield running


@pytest.fixture
def admin(cluster: LocalCluster) -> Iterator[Admin]:
    client = Admin(cluster.admin_address, TOKEN)
    yield client
    client.channel.close()


def _flight(cluster: LocalCluster, n: int = 6) -> Flight:
    return Flight(cluster.http_url, cluster.config.model.name, n=n)


def _migrating(admin: Admin, direction: str) -> int | None:
    """The rank of a replica with a migration in flight into it (`in`) or out of it (`out`), if any.

    Roles move between ranks as replicas die and come back (a decode replica takes the prefill role),
    so each case finds its victim by what it does, not by its rank."""
    for rank, status in admin.replicas().items():
        if (status.inbound_migrations if direction == "in" else status.outbound_migrations) > 0:
            return rank
    return None


def _ranks(admin: Admin, role: int) -> list[int]:
    return sorted(rank for rank, status in admin.replicas().items() if status.role == role)


def _kill(cluster: LocalCluster, rank: int) -> None:
    proc = cluster.replicas[rank].popen
    proc.kill()
    proc.wait(30)


@pytest.mark.timeout(300)
def test_receiver_killed_mid_migration(cluster: LocalCluster, admin: Admin) -> None:
    with _flight(cluster) as flight:
        wait_for(lambda: _migrating(admin, "in") is not None, 60, "a migration in flight")
        victim = _migrating(admin, "in")
        assert victim is not None
        _kill(cluster, victim)
    results = flight.check(DEADLINE)
    assert sum(r.finished for r in results) >= 1
    pages_back(cluster, [r for r in range(3) if r != victim])
    heal(cluster, admin, victim)


@pytest.mark.timeout(300)
def test_sender_killed_mid_migration(cluster: LocalCluster, admin: Admin) -> None:
    with _flight(cluster) as flight:
        wait_for(lambda: _migrating(admin, "out") is not None and _migrating(admin, "in") is not None, 60,
                 "a migration in flight")
        victim = _migrating(admin, "out")
        assert victim is not None
        _kill(cluster, victim)
    flight.check(DEADLINE)
    pages_back(cluster, [r for r in range(3) if r != victim])
    heal(cluster, admin, victim)


@pytest.mark.timeout(300)
def test_receiver_stalled_mid_migration(cluster: LocalCluster, admin: Admin) -> None:
    """SIGSTOP: the replica's sockets stay open and its process never answers (its gRPC front child
    too), as a hung host would."""
    flight = _flight(cluster).__enter__()
    wait_for(lambda: _migrating(admin, "in") is not None, 60, "a migration in flight")
    victim = _migrating(admin, "in")
    assert victim is not None
    pids = [cluster.replicas[victim].popen.pid, *descendants(cluster.replicas[victim].popen.pid)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: admin.replicas()[victim].role == pb.REPLICA_ROLE_DEAD, HEARTBEAT_TIMEOUT + 30,
                 "the stalled replica declared dead")
        flight.join()  # every request ends while the replica is still stalled
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    flight.check(DEADLINE)
    pages_back(cluster, [r for r in range(3) if r != victim])
    wait_for(lambda: admin.replicas()[victim].role != pb.REPLICA_ROLE_DEAD, 60, "the replica taken back")
    pages_back(cluster, range(3))


@pytest.mark.timeout(300)
def test_replica_restarted_with_its_rank_serves_again(cluster: LocalCluster, admin: Admin) -> None:
    first, other = _ranks(admin, pb.REPLICA_ROLE_DECODE)
    with _flight(cluster) as flight:
        flight.first_token.wait(60)
        _kill(cluster, first)
    flight.check(DEADLINE)
    heal(cluster, admin, first)
    assert admin.replicas()[first].role == pb.REPLICA_ROLE_DECODE
    other_id = admin.replicas()[other].id
    admin.stub.Drain(pb.DrainRequest(replica_id=other_id), timeout=30, metadata=admin.metadata)
    wait_for(lambda: admin.replicas()[other].role == pb.REPLICA_ROLE_IDLE, 60, "the other one idle")
    with _flight(cluster, n=3) as again:  # only the restarted replica decodes now
        pass
    results = again.check(DEADLINE)
    assert [(r.finished, r.decode_replica) for r in results] == [(True, admin.replicas()[first].id)] * 3
    admin.stub.SetRole(pb.SetRoleRequest(replica_id=other_id, role=pb.REPLICA_ROLE_DECODE), timeout=30,
                       metadata=admin.metadata)
    pages_back(cluster, range(3))


@pytest.mark.timeout(300)
def test_router_killed_mid_stream_then_restarted(cluster: LocalCluster, admin: Admin) -> None:
    assert cluster.router is not None
    with _flight(cluster) as flight:
        flight.first_token.wait(60)
        cluster.router.popen.kill()
        cluster.router.popen.wait(30)
    results = flight.check(30.0, clear=("RemoteProtocolError", "ReadError", "ConnectError", "HTTP 5",
                                        "stream error"))
    assert not all(r.finished for r in results)
    cluster.restart_router()  # clears what the replicas still cache for the router that died
    pages_back(cluster, range(3))
    with _flight(cluster, n=3) as again:
        pass
    results = again.check(DEADLINE)
    assert all(r.finished for r in results), results
    pages_back(cluster, range(3))
