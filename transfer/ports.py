"""Ports for listeners named in a rank table before they bind (they are drawn here, bound later).

Drawn below the kernel's ephemeral range: a port the kernel picked itself (bind to 0) and then
released is soon handed to some outgoing connection, and the listener's later bind then fails with
EADDRINUSE (seen when clusters start while others serve). A port outside that range can only be
taken by another explicit bind; each is checked free by binding it first.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def ephemeral_start() -> int:
    """The first port the kernel hands out to unbound sockets (outgoing connections, bind to 0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _draw_range() -> tuple[int, int]:
    """[low, high): the 12000 ports below the ephemeral range (above the privileged ones)."""
    high = ephemeral_start()
    return max(1024, high - 12000), high


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners bind
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """A first port p with p .. p+n-1 all free right now (a `--base-port`), drawn like `free_ports`."""
    low, high = _draw_range()
    rng = random.Random()
    for _ in range(1000):
        base = rng.randrange(low, high - n)
        if all(_bindable(host, base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports in [{low}, {high}) on {host}")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` right now, for listeners that bind them later."""
    low, high = _draw_range()
    rng = random.Random()
    found: list[int] = []
    for _ in range(100 * n + 1000):
        if len(found) == n:
            return found
        port = rng.randrange(low, high)
        if port not in found and _bindable(host, port):
            found.append(port)
    if len(found) == n:
        return found
    raise RuntimeError(f"no {n} free ports in [{low}, {high}) on {host}")
