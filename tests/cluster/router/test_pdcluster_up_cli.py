"""`pdcluster up` as a command: one ready line, serves, and SIGTERM stops every process it started."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.helpers.eventually import eventually
from tests.helpers.processes import alive, children_of

ROOT = Path(__file__).resolve().parents[3]


def port_open(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


def test_up_ready_line_serves_and_stops_everything(tiny_model_factory: Callable[..., Path],
                                                   tmp_path: Path) -> None:
    model = tiny_model_factory()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster", "up", "--model", str(model), "--prefill", "1", "--decode", "1",
         "--strategy", "recompute", "--http-port", "0", "--admin-port", "0", "--num-blocks", "128",
         "--log-dir", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("pdcluster up ready: "), line
        fields = dict(p.split("=", 1) for p in line.split() if "=" in p)
        url = fields["http"]
        replicas = [r.split("@", 1)[1] for r in line.split("replicas=[", 1)[1].split("]")[0].split()]
        children = children_of(proc.pid)
        assert len(children) == 3
        body = {"model": model.name, "prompt": "hello", "max_tokens": 5, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] >= 1
        assert answer["pdcluster_route"]["strategy"] == "recompute"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        eventually(lambda: not any(alive(c) for c in children), 10, interval=0.1, message="children exited")
        assert not any(port_open(a) for a in [*replicas, url.removeprefix("http://")])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
