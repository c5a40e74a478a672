"""Where a replica's threads run: its engine thread on CPU cores of its own (`--engine-cpus`).

The engine thread is the replica's pace-setter: every forward and every decode step runs there.
On a CPU-only host (or any host where a replica shares cores with its gRPC front process, a router
or a load generator) the scheduler moves it between cores and preempts it for the front's and the
router's per-call Python work, and it pays with cold caches each time. With `--engine-cpus` the
engine thread (and the torch threads it starts) runs only on those cores, and everything else of
the replica (the gRPC front process, the service threads, gRPC's own threads, the fabric's
threads) runs on the remaining cores the process may use:

```
 allowed cores (the process's affinity at start):  0 1 2 3
 --engine-cpus 3      engine thread (+ its torch threads) ─► 3
                      main thread, everything it starts    ─► 0 1 2   (inherited at creation)
```
What it buys, where cores are shared (`pdcluster bench replica` pins by default): docs/performance.md.

Linux only (`os.sched_setaffinity` on a thread id); pure Python, no torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass


class PlacementError(ValueError):
    """`--engine-cpus` cannot be honoured here (named cores not allowed, too many torch threads, no Linux)."""


def allowed_cpus() -> frozenset[int]:
    """The cores this process may run on now."""
    if not hasattr(os, "sched_getaffinity"):
        raise PlacementError("CPU placement needs Linux (os.sched_getaffinity)")
    return frozenset(os.sched_getaffinity(0))


@dataclass(frozen=True)
class CpuPlacement:
    """The engine thread's cores and every other thread's cores (disjoint unless nothing was left)."""

    engine: frozenset[int]
    others: frozenset[int]

    @classmethod
    def plan(cls, engine_cpus: Iterable[int], allowed: Iterable[int], torch_threads: int = 0) -> CpuPlacement:
        """Check `engine_cpus` against the `allowed` cores; the rest go to the other threads.

        When the engine takes every allowed core, the others share them (nothing else is possible).
        `torch_threads` (0 = one per engine core) may not exceed the engine's cores: extra intra-op
        threads would only time-slice one core.
        """
        engine, allowed = frozenset(engine_cpus), frozenset(allowed)
        if not engine:
            raise PlacementError("--engine-cpus needs at least one core")
        if not engine <= allowed:
            raise PlacementError(
                f"--engine-cpus {sorted(engine - allowed)} not among the cores this process may use "
                f"{sorted(allowed)}"
            )
        if torch_threads > len(engine):
            raise PlacementError(
                f"--torch-threads {torch_threads} is more than the {len(engine)} core(s) of --engine-cpus"
            )
        return cls(engine, allowed - engine or allowed)

    def torch_threads(self, configured: int) -> int:
        """The intra-op thread count to use: the configured one, else one per engine core."""
        return configured or len(self.engine)

    def apply_to_process(self) -> None:
        """Every thread so far to `others`; call it on the main thread before the engine thread and
        the front process start (threads and processes inherit their creator's cores)."""
        set_process_cpus(self.others)

    def apply_to_engine_thread(self) -> None:
        """On the engine thread itself (the torch threads it starts later inherit `engine`)."""
        set_thread_cpus(self.engine)

    def describe(self) -> str:
        """One line for the replica's log."""
        return f"engine thread on cores {sorted(self.engine)}, other threads on {sorted(self.others)}"


def set_thread_cpus(cpus: Iterable[int]) -> None:
    """Restrict the calling thread (Linux: pid 0 is the calling thread) to `cpus`."""
    if not hasattr(os, "sched_setaffinity"):
        raise PlacementError("CPU placement needs Linux (os.sched_setaffinity)")
    os.sched_setaffinity(0, set(cpus))


def set_process_cpus(cpus: Iterable[int]) -> None:
    """Restrict every thread of this process as it is now (and, through the main thread, later ones)."""
    if not hasattr(os, "sched_setaffinity"):
        raise PlacementError("CPU placement needs Linux (os.sched_setaffinity)")
    wanted = set(cpus)
    for entry in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(entry), wanted)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
