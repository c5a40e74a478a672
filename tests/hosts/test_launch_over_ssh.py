"""`pdcluster launch --via ssh` over real OpenSSH servers on three emulated hosts with 1 Gbit/s links:
1 prefill + 2 decode replicas serve transformers' greedy output, a KV migration crosses a shaped
link at the link's rate, `status` lists every replica, `down` leaves nothing on any host; a host
that refuses the key, and one whose replica cannot start, fail the launch naming the host; with
`[tls]` (mutual) and a token file the certificates and token reach the hosts over ssh, the router
serves HTTPS, `status` reaches every replica over TLS and a replica wants the token."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.emulated_hosts import EmulatedHosts
from tests.helpers.host_checks import (
    ROUTER_LINES,
    check_serving,
    check_tls_and_token,
    head_run,
    no_process_left,
    secure,
)
from tests.helpers.launched import Launched, NodeLine, pdcluster, write_cluster_file
from tests.helpers.router_cluster import GreedyOracle

pytestmark = pytest.mark.timeout(900)  # the first test of a session may install packages first


def cluster_file(
    hosts: EmulatedHosts,
    model: Path,
    extra: dict[str, tuple[str, ...]] | None = None,
    launch: tuple[str, ...] = (),
) -> Path:
    roles = ({"prefill": 1}, {"decode": 1}, {"decode": 1})
    nodes = [
        NodeLine(h.name, h.address, r, ("nic_gbps = 1", *(extra or {}).get(h.name, ())))
        for h, r in zip(hosts.hosts, roles, strict=True)
    ]
    return write_cluster_file(
        hosts.folder / "cluster.toml", model, nodes, "ssh", hosts.head_address, launch, hosts.ssh_config,
        ROUTER_LINES,
    )


def launch(hosts: EmulatedHosts, file: Path) -> Launched:
    return Launched(["ip", "netns", "exec", hosts.head, *pdcluster("launch", str(file))])


def test_ssh_launch_serves_migrates_lists_and_leaves_nothing(
    ssh_hosts: EmulatedHosts, kv_model: Path, kv_oracle: GreedyOracle
) -> None:
    file = cluster_file(ssh_hosts, kv_model)
    launched = launch(ssh_hosts, file)
    try:
        ratio = check_serving(ssh_hosts, launched, file, kv_model, kv_oracle)
        print(f"\nmigration time / (bytes / 1 Gbit/s) = {ratio:.3f}; launch: {launched.stderr}")
        node_dir = Path(json.loads((file.parent / "logs" / "run.json").read_text())["node_dir"])
        down = head_run(ssh_hosts, "down", str(file))
        assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
        assert launched.wait(60) == 0
        no_process_left(ssh_hosts)
        assert not node_dir.exists()
        assert head_run(ssh_hosts, "status", str(file)).returncode == 3  # not running
    finally:
        launched.kill()


def test_a_host_refusing_the_key_fails_the_launch_naming_it(ssh_hosts: EmulatedHosts, kv_model: Path) -> None:
    h3 = ssh_hosts.hosts[2]
    ssh_hosts.restart_sshd(h3, refuse_key=True)
    file = cluster_file(ssh_hosts, kv_model, launch=("# one deadline for everything",))
    start = time.monotonic()
    launched = launch(ssh_hosts, file)
    try:
        assert launched.wait(120) == 1
        assert time.monotonic() - start < 60, launched.stderr
        assert (
            f"node h3 ({h3.address}): discovery failed: ssh to {h3.address} failed: "
            f"root@{h3.address}: Permission denied (publickey)."
        ) in launched.stderr
        no_process_left(ssh_hosts)
    finally:
        launched.kill()


def test_a_replica_that_cannot_start_stops_the_others(ssh_hosts: EmulatedHosts, kv_model: Path) -> None:
    """h3's replica dies at start (a broken Python environment there); h1's and h2's, already
    started over ssh, are stopped, and the launch names h3 with the end of its log."""
    file = cluster_file(ssh_hosts, kv_model, extra={"h3": ('env = { PYTHONHOME = "/nonexistent" }',)})
    launched = launch(ssh_hosts, file)
    try:
        assert launched.wait(120) == 1
        err = launched.stderr
        assert (
            f"node h3 ({ssh_hosts.hosts[2].address}) failed to start: replica-2-decode on h3 exited" in err
        ), err
        assert "exited with 1: ModuleNotFoundError: No module named 'encodings'" in err
        assert "its log ends:" in err and "Fatal Python error" in err
        record = json.loads((file.parent / "logs" / "run.json").read_text())
        assert record["phase"] == "failed" and "node h3" in record["message"]
        started = [p.parent.name for p in Path(record["logs"]).glob("*/replica-*.log")]
        assert sorted(started) == ["h1", "h2", "h3"]  # the others' sessions had started ...
        no_process_left(ssh_hosts)  # ... and were stopped
    finally:
        launched.kill()


def test_ssh_launch_with_mutual_tls_and_a_token(
    ssh_hosts: EmulatedHosts, tiny_model_factory: Callable[..., Path]
) -> None:
    model = tiny_model_factory()
    file = cluster_file(ssh_hosts, model)
    secure(ssh_hosts, file)
    launched = launch(ssh_hosts, file)
    try:
        check_tls_and_token(ssh_hosts, launched, file, model)
        assert head_run(ssh_hosts, "down", str(file)).returncode == 0 and launched.wait(60) == 0
        no_process_left(ssh_hosts)
    finally:
        launched.kill()
