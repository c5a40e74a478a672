"""Short commands on many nodes at once: a bounded pool of ssh / srun / local sessions, each with a
deadline, each answer kept with the node it came from.

```
 fan_out(nodes, argv_of, timeout, parallel=32, stdin_of) ─► [Answer(node, rc, out, err, seconds)]
```
Used for discovery, staging the rank table, stopping a run's replicas and collecting node logs.
The long-lived replica sessions are `processes.Proc`s instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pdcluster import SOURCE_ROOT
from pdcluster.cluster.clusterfile import NodeSpec, Via

SSH_FAILED = 255  # ssh's own exit code: the connection or the authentication failed


@dataclass(frozen=True)
class Answer:
    """What one node answered."""

    node: NodeSpec
    rc: int  # -1: the deadline passed first
    out: str
    err: str
    seconds: float

    @property
    def ok(self) -> bool:
        """Exit code 0."""
        return self.rc == 0

    def why(self, via: Via) -> str:
        """One line saying why the command failed on this node."""
        err = next((line.strip() for line in reversed(self.err.splitlines()) if line.strip()), "")
        if self.rc == -1:
            return f"no answer within {self.seconds:.0f} s"
        if via is Via.SSH and self.rc == SSH_FAILED:
            return f"ssh to {self.node.address} failed: {err or 'exit 255'}"
        return f"exited with {self.rc}" + (f": {err}" if err else "")


def run_once(node: NodeSpec, argv: Sequence[str], stdin: str | Path | None, timeout: float) -> Answer:
    """Run `argv` (in its own process group, so a timeout kills ssh / srun and their children) with
    `stdin` on its stdin: a text, or a file's bytes read straight from disk (a wheelhouse's tar)."""
    start = time.monotonic()
    with contextlib.ExitStack() as files:
        source: int | IO[bytes] = subprocess.PIPE if isinstance(stdin, str) else subprocess.DEVNULL
        if isinstance(stdin, Path):
            source = files.enter_context(stdin.open("rb"))
        proc = subprocess.Popen(list(argv), stdin=source, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=SOURCE_ROOT, start_new_session=True)
    text = stdin if isinstance(stdin, str) else None
    try:
        out, err = proc.communicate(text, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Answer(node, -1, out, err, time.monotonic() - start)
    return Answer(node, proc.returncode, out, err, time.monotonic() - start)


def fan_out(nodes: Sequence[NodeSpec], argv_of: Callable[[NodeSpec], Sequence[str]], timeout: float,
            parallel: int, stdin_of: Callable[[NodeSpec], str | Path] | None = None) -> list[Answer]:
    """`argv_of(node)` on every node (`stdin_of(node)` on its stdin), at most `parallel` at once;
    answers in `nodes` order. A `Path` from `stdin_of` is streamed from disk, never read into memory."""
    def one(node: NodeSpec) -> Answer:
        return run_once(node, argv_of(node), stdin_of(node) if stdin_of else None, timeout)

    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(nodes)))) as pool:
        return list(pool.map(one, nodes))
