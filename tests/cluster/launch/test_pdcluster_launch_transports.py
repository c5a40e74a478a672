"""`pdcluster launch`: replicas started through the remote-command path (`--transport local`, and
`ssh` / `srun` through stand-ins on PATH that run the command here the way sshd and srun would), the
router serves a greedy completion, and SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from pdcluster.cluster.replica_process import free_port_run
from tests.helpers.eventually import eventually
from tests.helpers.processes import alive, descendants

ROOT = Path(__file__).resolve().parents[3]


# Stand-ins for the two remote launchers. Each logs its own argv, then runs the command here as the
# real one would on the node: sshd starts in $HOME with a fresh environment (nothing of this venv or
# shell) and hands the command words, joined by spaces, to the login shell's `-c` (so the command is
# parsed by a shell once more); srun execs its argv in the submitting directory and environment.
FAKE_SSH = """#!/bin/bash
printf '%s\\0' "$*" >> "$PDCLUSTER_FAKE_LOG"
while [ $# -gt 0 ]; do
  case "$1" in
    -tt|-t) shift ;;
    -o) shift 2 ;;
    *) break ;;
  esac
done
host=$1; shift
[ "$host" = 127.0.0.1 ] || { echo "fake ssh: unknown host $host" >&2; exit 255; }
cd "$HOME" || exit 255
exec env -i HOME="$HOME" PATH=/usr/bin:/bin bash -c "$*"
"""
FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$*" >> "$PDCLUSTER_FAKE_LOG"
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""


def fake_launchers(tmp_path: Path) -> dict[str, str]:
    """PATH with `ssh` and `srun` stand-ins first, and where they log their argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ssh", FAKE_SSH), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PDCLUSTER_FAKE_LOG": str(tmp_path / "launchers.log")}


@pytest.mark.parametrize("transport", ["local", "ssh", "srun"])
def test_launch_serves_and_sigterm_leaves_no_children(
        tiny_model_factory: Callable[..., Path], tmp_path: Path, transport: str) -> None:
    model = tiny_model_factory()
    hosts = tmp_path / "hosts"
    hosts.write_text("# one node, both replicas\n127.0.0.1 slots=2\n")
    env = {**os.environ, **fake_launchers(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster", "launch", "--hosts", str(hosts), "--transport", transport,
         "--model", str(model), "--prefill", "1", "--decode", "1", "--strategy", "recompute",
         "--base-port", str(free_port_run(2)), "--transfer-base-port", str(free_port_run(2)),
         "--http-port", "0", "--admin-port", "0", "--num-blocks", "128", "--torch-threads", "1",
         "--log-dir", str(tmp_path / "logs"), "--ready-timeout", "120"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("pdcluster launch ready: "), (line, list((tmp_path / "logs").glob("*.log")))
        assert "prefill@127.0.0.1:" in line and "decode@127.0.0.1:" in line
        url = dict(p.split("=", 1) for p in line.split() if "=" in p)["http"]
        children = descendants(proc.pid)
        assert len(children) == 5  # two replicas (bash exec'd into them), their gRPC fronts, the router
        body = {"model": model.name, "prompt": "hello", "max_tokens": 5, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] >= 1
        assert answer["pdcluster_route"]["strategy"] == "recompute"
        log = Path(env["PDCLUSTER_FAKE_LOG"])
        calls = log.read_text().split("\0")[:-1] if log.exists() else []  # one NUL-ended record per call
        if transport == "ssh":  # one session per replica, with a terminal, never asking for a password
            session = "-tt -o BatchMode=yes 127.0.0.1 bash -c "
            assert len(calls) == 2 and all(c.startswith(session) for c in calls)
        elif transport == "srun":  # one task per replica, on the node the hosts file named
            assert len(calls) == 2 and all("--nodelist=127.0.0.1" in c and "--ntasks=1" in c for c in calls)
        else:
            assert calls == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        eventually(lambda: not any(alive(c) for c in children), 10, interval=0.1,
                   message=lambda: f"every child exited (alive: {[c for c in children if alive(c)]})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
