"""Test helpers for the transfer layer: groups of fabrics, running ranks in threads, leak checks."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from transfer.fabric import Fabric
from transfer.fake import FakeFabric, FakeFaults, FakeNetwork
from transfer.ports import free_ports
from transfer.ranktable import RankTable
from transfer.rendezvous import DictRendezvous
from transfer.tcp.fabric import TcpFabric

FabricMaker = Callable[[int], list[Fabric]]


def local_table(n: int) -> RankTable:
    """A one-node rank table of `n` ranks on free loopback ports."""
    return RankTable.local(free_ports(n))


def make_tcp(n: int, **options: Any) -> list[Fabric]:
    """`n` TCP fabrics in this process."""
    table = local_table(n)
    return [TcpFabric(table, r, **options) for r in range(n)]


def make_tcp_counting_resets(n: int) -> list[Fabric]:
    """`n` TCP fabrics sharing edge generations (`transfer.rendezvous.Resets`), as replicas with a store."""
    resets = DictRendezvous()
    return make_tcp(n, resets=resets)


def make_fake(n: int, faults: FakeFaults | None = None) -> list[Fabric]:
    """`n` fake fabrics on one network."""
    table = local_table(n)
    network = FakeNetwork(faults)
    return [FakeFabric(table, r, network=network) for r in range(n)]


@contextlib.contextmanager
def fabric_group(maker: FabricMaker, n: int) -> Iterator[list[Fabric]]:
    """Fabrics that are closed on exit, whatever happens."""
    fabrics = maker(n)
    try:
        yield fabrics
    finally:
        for fabric in fabrics:
            fabric.close()


def run_all(jobs: Sequence[Callable[[], object]], timeout: float = 60.0) -> list[BaseException | None]:
    """Run each job in its own thread; return each job's exception (or None)."""
    errors: list[BaseException | None] = [None] * len(jobs)

    def wrap(i: int) -> None:
        try:
            jobs[i]()
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError("a rank did not finish: the transfer layer hung")
    return errors


def socket_fds() -> int:
    """Open socket file descriptors of this process."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
    return count


def thread_names() -> set[str]:
    """Names of live threads (to spot leaks)."""
    return {t.name for t in threading.enumerate()}


def make_staged_tcp(n: int, copy_delay_s: float = 0.0005, **options: Any) -> list[Fabric]:
    """`n` staging fabrics over tcp whose numpy buffers are device memory (a slow CPU double)."""
    from tests.helpers.staged_devices import DoubleDevices
    from transfer.staged import StagedFabric

    return [StagedFabric(inner, DoubleDevices(copy_delay_s), **options) for inner in make_tcp(n)]


def make_staged_fake(n: int, copy_delay_s: float = 0.0005) -> list[Fabric]:
    """`n` staging fabrics over fake fabrics, numpy buffers as device memory."""
    from tests.helpers.staged_devices import DoubleDevices
    from transfer.staged import StagedFabric

    return [StagedFabric(inner, DoubleDevices(copy_delay_s)) for inner in make_fake(n)]
