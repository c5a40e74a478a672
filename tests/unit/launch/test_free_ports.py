"""Ports for rank tables are drawn outside the kernel's ephemeral range, so no outgoing connection
can take one between the draw and the listener's bind."""

from __future__ import annotations

import socket

from pdcluster.cluster.replica_process import free_port_run, free_ports
from transfer.ports import ephemeral_start


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(1024 <= p < ephemeral_start() for p in ports)
    socks = [socket.socket() for _ in ports]
    try:
        for sock, port in zip(socks, ports, strict=True):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    finally:
        for sock in socks:
            sock.close()


def test_a_run_of_free_ports_is_consecutive_and_below_the_ephemeral_range() -> None:
    base = free_port_run(3)
    assert base >= 1024 and base + 3 <= ephemeral_start()
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for sock, port in ((a, base), (b, base + 1), (c, base + 2)):
            sock.bind(("127.0.0.1", port))
