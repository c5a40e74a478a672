"""Resource samples of a process and its descendants, from Linux's /proc (psutil is not a dependency;
these are three numbers per process).

```
 pid ─► /proc/PID/status (VmRSS, Threads), /proc/PID/fd (count) ─► Usage
    └─► /proc/PID/task/*/children ─► the same for each child (the replica's gRPC front process)
```
A process that exits between two reads is skipped (None), never an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Usage:
    """One process at one instant."""

    pid: int
    rss_mib: float
    fds: int
    threads: int


def usage(pid: int) -> Usage | None:
    """RSS, open file descriptors and threads of `pid` (None: it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie has no memory left to report
        return None
    rss_kib = int(fields["VmRSS"].split()[0])
    return Usage(pid, rss_kib / 1024, fds, int(fields["Threads"]))


def children(pid: int) -> list[int]:
    """Direct children of `pid` (empty when it is gone)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return found


def tree(name: str, pid: int) -> dict[str, Usage]:
    """`name` → its usage, and `name/child-K` → each descendant's (K in pid order, so a stable name)."""
    out: dict[str, Usage] = {}
    top = usage(pid)
    if top is None:
        return out
    out[name] = top
    for k, child in enumerate(sorted(children(pid))):
        out.update(tree(f"{name}/child-{k}", child))
    return out
