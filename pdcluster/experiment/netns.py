"""The kernel topology backend: each node a network namespace, its links shaped by `tc`.

```
 pdcx-<run>-h (router, load gen.)   pdcx-<run>-sw (the switch)            pdcx-<run>-n0 (node 0)
 eth0 198.18.0.1 ── veth ── port-h ┐                       ┌ port-n0 ── veth ── eth0 198.18.0.2
                                   ├──── br0 (bridge) ─────┤  tbf (RX)         netem + tbf (TX)
                                   │                       └ port-n1 ── … node 1 (198.18.0.3)
                                   └ (head: not shaped)        lo of a node: tbf at the intra-node rate
```
Every interface is created inside a namespace of the run (never in the host's), so the addresses
(198.18.0.0/24, the benchmarking range) exist only there and no packet to them leaves the run's
namespaces; deleting the namespaces deletes every link. Node `i`'s veth is shaped on both ends at
its NIC rate (`tbf`: what it sends, and what the switch sends it), and what it sends is delayed by
its latency (`netem`); replicas of one node talk over its loopback, shaped at the intra-node rate.
The head's link (router ↔ replicas, the load generator) is not shaped.

Names carry the run id (`pdcx-<8 hex>-…`). A marker file per run (`MARKERS/<run>.pid`, written before
anything is made) holds the owner's pid: `sweep()` deletes the namespaces of every run whose owner is
gone — the stale-run sweep each new network does first — and never another live run's.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pdcluster.experiment.spec import NodeSpec

PREFIX = "pdcx-"
MARKERS = Path("/run/pdcluster-experiment")
SUBNET = "198.18.0"  # RFC 2544's benchmarking range; exists only inside the run's namespaces
HEAD_ADDRESS = f"{SUBNET}.1"
_NS_RE = re.compile(rf"^{PREFIX}([0-9a-f]{{8}})-")
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made (the command and its message)."""


def unavailable(latency: bool = False) -> str:
    """Why the kernel backend cannot run here ("" when it can); `latency`: links with a delay (netem)."""
    if os.geteuid() != 0:
        return "the kernel topology backend needs root (network namespaces, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the kernel topology backend needs {' and '.join(missing)} (iproute2) on PATH"
    kinds = ("tbf", "netem") if latency else ("tbf",)
    if kinds not in _QDISCS:  # probed once per process
        _QDISCS[kinds] = qdisc_missing(kinds)
    if _QDISCS[kinds]:
        return f"this kernel has no {' or '.join(_QDISCS[kinds])} qdisc (tc), which the topology's links need"
    return ""


_QDISCS: dict[tuple[str, ...], list[str]] = {}


def qdisc_missing(kinds: Sequence[str]) -> list[str]:
    """The qdisc kinds out of `kinds` that this kernel cannot make (tried on the loopback of a
    throwaway namespace): `netem` is missing from some kernels built without it."""
    probe = f"{PREFIX}{uuid.uuid4().hex[:8]}-probe"
    missing = []
    _run("ip", "netns", "add", probe)
    try:
        for kind in kinds:
            args = {"netem": ["netem", "delay", "1ms"], "tbf": _tbf(1.0)}[kind]
            done = _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", *args,
                        check=False)
            if done.returncode != 0:
                missing.append(kind)
            else:
                _run("ip", "netns", "exec", probe, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return missing


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        message = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        raise NetnsError(f"{' '.join(argv)}: {message}")
    return done


def namespaces() -> list[str]:
    """Names of the network namespaces on this machine."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def host_addresses() -> list[str]:
    """Addresses of the runs' subnet in the namespace of this process (the host's): always none,
    since every interface of a run is made inside the run's namespaces."""
    out = _run("ip", "-o", "addr", "show", check=False).stdout
    return [word for word in out.split() if word.startswith(f"{SUBNET}.")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(run: str) -> int:
    """The pid that owns `run` (0 when its marker is missing or unreadable)."""
    try:
        return int((MARKERS / f"{run}.pid").read_text().strip())
    except (OSError, ValueError):
        return 0


def sweep() -> list[str]:
    """Delete the namespaces (and markers) of runs whose owner is gone; returns the deleted names."""
    stale = [ns for ns in namespaces() if (m := _NS_RE.match(ns)) and not (
        (pid := _owner(m.group(1))) and _alive(pid))]
    for ns in stale:
        _run("ip", "netns", "del", ns, check=False)
    live_runs = {m.group(1) for ns in namespaces() if (m := _NS_RE.match(ns))}
    if MARKERS.is_dir():
        for marker in MARKERS.glob("*.pid"):
            pid = _owner(marker.stem)
            if marker.stem not in live_runs and not (pid and _alive(pid)):
                marker.unlink(missing_ok=True)
    return stale


@dataclass(frozen=True)
class Node:
    """A node of the network: its namespace and its address."""

    name: str
    namespace: str
    address: str

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class Network:
    """The namespaces, links and qdiscs of one run; `close()` (or leaving the `with`) removes them all."""

    def __init__(self, nodes: Sequence[NodeSpec], run_id: str = "") -> None:
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.specs = tuple(nodes)
        self.switch = f"{PREFIX}{self.run_id}-sw"
        self.head = Node("head", f"{PREFIX}{self.run_id}-h", HEAD_ADDRESS)
        self.nodes = tuple(Node(spec.name, f"{PREFIX}{self.run_id}-n{i}", f"{SUBNET}.{i + 2}")
                           for i, spec in enumerate(self.specs))
        if len(self.nodes) > 200:
            raise ValueError("at most 200 nodes fit the network's /24")
        self._made: list[str] = []

    def __enter__(self) -> Network:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """Sweep stale runs, then make the switch, the head and every node with its shaping."""
        sweep()
        MARKERS.mkdir(parents=True, exist_ok=True)
        (MARKERS / f"{self.run_id}.pid").write_text(f"{os.getpid()}\n")
        self._namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        self._attach(self.head, "port-h")
        for i, (node, spec) in enumerate(zip(self.nodes, self.specs, strict=True)):
            self._attach(node, f"port-n{i}")
            self._shape(node, spec, f"port-n{i}")

    def _namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _attach(self, node: Node, port: str) -> None:
        """A namespace for `node`, linked to the switch by a veth pair (`port` on the switch side)."""
        self._namespace(node.namespace)
        _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
             "netns", node.namespace)
        _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
        _run("ip", "-n", node.namespace, "link", "set", "eth0", "up")

    def _shape(self, node: Node, spec: NodeSpec, port: str) -> None:
        if spec.latency_ms > 0:
            _tc(node.namespace, "eth0", "root", "handle", "1:", "netem", "delay", f"{spec.latency_ms}ms",
                "limit", "100000")
        if spec.nic_gbps > 0:
            parent = ("parent", "1:1") if spec.latency_ms > 0 else ("root",)
            _tc(node.namespace, "eth0", *parent, "handle", "10:", *_tbf(spec.nic_gbps))
            _tc(self.switch, port, "root", "handle", "10:", *_tbf(spec.nic_gbps))
        if spec.intra_gbps > 0:
            _tc(node.namespace, "lo", "root", "handle", "10:", *_tbf(spec.intra_gbps))

    def node_of(self, index: int) -> Node:
        """Node `index` of the topology."""
        return self.nodes[index]

    def close(self) -> None:
        """Delete every namespace this run made (their links and qdiscs go with them) and its marker."""
        for name in reversed(self._made):
            _run("ip", "netns", "del", name, check=False)
        self._made.clear()
        (MARKERS / f"{self.run_id}.pid").unlink(missing_ok=True)

    def leftovers(self) -> list[str]:
        """Namespaces of this run that still exist (none after `close`)."""
        return [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{self.run_id}-")]


def _tbf(gbps: float) -> list[str]:
    """tbf arguments for `gbps`: a bucket of 2 ms at the rate (at least two 64 KiB segments) so the
    rate holds with large segments, and 50 ms of queue."""
    rate_bytes = gbps * 1e9 / 8
    burst = max(131072, int(rate_bytes * 0.002))
    return ["tbf", "rate", f"{gbps * 1000:g}mbit", "burst", str(burst), "latency", "50ms"]


def _tc(namespace: str, dev: str, *args: str) -> None:
    _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", dev, *args)


def in_namespace(namespace: str | None, work: Callable[[], T]) -> T:
    """Run `work()` on a thread that has entered `namespace` (this thread when None): sockets it
    opens live in that namespace. Only that thread moves; the process stays where it is."""
    if namespace is None:
        return work()
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            enter(namespace)
            result.append(work())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=body, name=f"netns-{namespace}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def enter(namespace: str) -> None:
    """Move the calling thread into `namespace` (setns(2) on /run/netns/NAME)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    with open(f"/run/netns/{namespace}", "rb") as handle:
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NetnsError(f"setns into {namespace}: {os.strerror(errno)}")
