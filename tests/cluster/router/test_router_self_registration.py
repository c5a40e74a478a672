"""A router started without replicas; a real replica started with `--router` registers itself,
serves, and is declared dead once it stops heartbeating (killed)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.helpers.eventually import eventually
from tests.helpers.router_cluster import grpcurl

ROOT = Path(__file__).resolve().parents[3]


def start(args: list[str], log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pdcluster", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True)


def test_replica_registers_serves_and_expires(tiny_model_factory: Callable[..., Path], tmp_path: Path
                                              ) -> None:
    model = tiny_model_factory()
    router = start(["router", "--model", str(model), "--http-port", "0", "--admin-port", "0",
                    "--admin-token", "tok", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2"],
                   tmp_path / "router.log")
    replica = None
    try:
        assert router.stdout is not None
        line = router.stdout.readline()
        assert line.startswith("pdcluster router ready:"), line
        fields = dict(p.split("=", 1) for p in line.split() if "=" in p)
        admin, url = fields["admin"], fields["http"]
        assert grpcurl(admin, "ListReplicas") == {}
        replica = start(["replica", "--model", str(model), "--port", "0", "--num-blocks", "64",
                         "--router", admin, "--role", "colocated", "--router-token", "tok"],
                        tmp_path / "replica.log")

        def listed() -> list[dict[str, object]]:
            return list(grpcurl(admin, "ListReplicas").get("replicas", []))

        eventually(lambda: len(listed()) == 1, 120, interval=0.2, message="the replica registered")
        entry = listed()[0]
        assert entry["registered"] is True and entry["role"] == "REPLICA_ROLE_COLOCATED"
        body = {"model": model.name, "prompt": "hi", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] >= 1
        replica.kill()
        eventually(lambda: listed()[0]["role"] == "REPLICA_ROLE_DEAD", 30, interval=0.2,
                   message="the replica dead once its beats stopped")
        router.send_signal(signal.SIGTERM)
        assert router.wait(30) == 0
    finally:
        for proc in (replica, router):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
