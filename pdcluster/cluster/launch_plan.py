"""The pure half of `pdcluster launch`: nodes, replica placement, the rank table and the commands.

Nothing here starts a process or reads the environment, so every piece is unit-tested as data.
"""

from __future__ import annotations

import enum
import shlex
from dataclasses import dataclass
from pathlib import Path

from transfer.ranktable import RankTable


class Transport(enum.Enum):
    """How a replica command reaches its node."""

    SSH = "ssh"
    SRUN = "srun"
    LOCAL = "local"  # the "remote" command runs as a local subprocess (tests, one-node debugging)


@dataclass(frozen=True)
class Node:
    """One line of the hosts file: `host [slots=N] [transfer_host=IP]`."""

    host: str
    slots: int = 1
    transfer_host: str = ""

    @property
    def transfer_ip(self) -> str:
        """Address of the transfer fabric on this node (the host itself unless told otherwise)."""
        return self.transfer_host or self.host


@dataclass(frozen=True)
class Placement:
    """One replica: its rank, role, node and the two ports it listens on there."""

    rank: int
    role: str
    node: Node
    port: int
    transfer_port: int

    @property
    def address(self) -> str:
        """gRPC address HOST:PORT."""
        return f"{self.node.host}:{self.port}"


def parse_hosts(text: str) -> list[Node]:
    """Nodes of a hosts file; `#` starts a comment; unknown keys or bad slot counts raise ValueError."""
    nodes = []
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        opts: dict[str, str] = {}
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or key not in ("slots", "transfer_host") or not value:
                raise ValueError(f"hosts line {number}: expected slots=N or transfer_host=IP, got {word!r}")
            opts[key] = value
        slots = int(opts.get("slots", "1"))
        if slots < 1:
            raise ValueError(f"hosts line {number}: slots must be >= 1")
        nodes.append(Node(words[0], slots, opts.get("transfer_host", "")))
    if not nodes:
        raise ValueError("the hosts file names no node")
    return nodes


def assign(roles: list[str], nodes: list[Node], base_port: int, transfer_base_port: int) -> list[Placement]:
    """Rank r goes to the next node (round-robin) that has a slot left; ports count up per node."""
    if len(roles) > sum(n.slots for n in nodes):
        raise ValueError(f"{len(roles)} replicas but only {sum(n.slots for n in nodes)} slots")
    used = [0] * len(nodes)
    placements = []
    index = 0
    for rank, role in enumerate(roles):
        while used[index] >= nodes[index].slots:
            index = (index + 1) % len(nodes)
        local = used[index]
        used[index] += 1
        placements.append(Placement(rank, role, nodes[index], base_port + local, transfer_base_port + local))
        index = (index + 1) % len(nodes)
    return placements


def rank_table(placements: list[Placement]) -> RankTable:
    """The rank table every replica reads (same format as `pdcluster up`'s)."""
    return RankTable.from_records(
        {"rank": p.rank, "host": p.node.host, "node": p.node.host, "device": "cpu",
         "transfer_address": f"{p.node.transfer_ip}:{p.transfer_port}", "grpc_port": p.port}
        for p in placements)


@dataclass(frozen=True)
class ReplicaCommand:
    """What `pdcluster launch` runs for one replica, as argv on this machine."""

    placement: Placement
    argv: list[str]


def replica_args(p: Placement, model: Path, ranks_path: Path, extra: list[str]) -> list[str]:
    """Arguments of `pdcluster replica` for one placement."""
    args = ["replica", "--model", str(model), "--rank", str(p.rank), "--cluster", str(ranks_path),
            "--fabric", "tcp", "--host", p.node.host, "--port", str(p.port), *extra]
    return [*args, "--inactive"] if p.role == "inactive" else args


def remote_script(pdcluster: list[str], args: list[str], workdir: Path, ranks_path: Path,
                  table_json: str | None, log_path: Path) -> str:
    """The shell script run on the node: write the rank table (unless shared), then exec the replica.

    `exec` makes the replica the session's own process, so a hangup or signal reaches it directly.
    Its stderr goes to `log_path` on the node: under `ssh -tt` it would otherwise share the streamed
    stdout and pile up here after the ready line.
    """
    lines = [f"cd {shlex.quote(str(workdir))} || exit 1",
             f"mkdir -p {shlex.quote(str(log_path.parent))} || exit 1"]
    if table_json is not None:
        lines += [f"mkdir -p {shlex.quote(str(ranks_path.parent))} || exit 1",
                  f"cat > {shlex.quote(str(ranks_path))} <<'PDCLUSTER_RANKS'", table_json, "PDCLUSTER_RANKS"]
    lines.append("exec " + shlex.join([*pdcluster, *args]) + " 2>>" + shlex.quote(str(log_path)))
    return "\n".join(lines)


def wrap(transport: Transport, host: str, script: str, rank: int) -> list[str]:
    """argv that runs `script` on `host` and streams its stdout back here.

    ssh: `-tt` gives the remote command a terminal, so closing the session (ssh killed) hangs it
    up and the replica dies with it. srun: one task on that node; signalling srun signals the step.
    """
    if transport is Transport.SSH:
        return ["ssh", "-tt", "-o", "BatchMode=yes", host, "bash -c " + shlex.quote(script)]
    if transport is Transport.SRUN:
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--kill-on-bad-exit=1",
                f"--job-name=pdcluster-r{rank}", "bash", "-c", script]
    return ["bash", "-c", script]


def router_args(placements: list[Placement], addresses: list[str], model: Path, host: str,
                http_port: int, admin_port: int, strategy: str) -> list[str]:
    """Arguments of `pdcluster router` over the started replicas."""
    return ["router", "--model", str(model), "--host", host, "--http-port", str(http_port),
            "--admin-port", str(admin_port), "--strategy", strategy, "--replica", *addresses,
            "--role", *[p.role for p in placements]]
