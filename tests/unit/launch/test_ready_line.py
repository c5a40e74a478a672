"""A replica's ready line is found whole when another process of its session (a tensor-parallel
worker's library, writing to the same `2>&1` stream) left a partial line just before it."""

from __future__ import annotations

import time
from pathlib import Path

from pdcluster.cluster.processes import REPLICA_READY, spawn, stop_procs


def test_the_ready_line_is_read_from_its_prefix_on(tmp_path: Path) -> None:
    script = f"printf 'W1127 gloo: partial'; printf '{REPLICA_READY}127.0.0.1:5\\n'; sleep 30"
    proc = spawn("replica-0", "prefill", ["bash", "-c", script], tmp_path / "r.log",
                 ready_prefix=REPLICA_READY)
    try:
        assert proc.wait_ready(time.monotonic() + 20) == f"{REPLICA_READY}127.0.0.1:5"
        assert "W1127 gloo: partial" in (tmp_path / "r.log").read_text()  # the log keeps the whole line
    finally:
        stop_procs([proc])
