"""`pdcluster up` as a new user meets it: every replica killed comes back on its address and the router
serves again; a spent restart budget stops the router too and exits 1; a replica or router that
cannot start is named with the line of its log that says why, in one line, without a traceback."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from pdcluster.cluster.replica_process import free_port_run
from tests.helpers.launched import Launched, pdcluster, ready_fields
from tests.helpers.processes import alive, children_of


def up(model: Path, tmp_path: Path, *extra: str) -> Launched:
    return Launched(
        pdcluster(
            "up",
            "--model",
            str(model),
            "--http-port",
            "0",
            "--admin-port",
            "0",
            "--num-blocks",
            "128",
            "--torch-threads",
            "1",
            "--log-dir",
            str(tmp_path / "logs"),
            *extra,
        )
    )


def replicas_of(pid: int) -> list[int]:
    def cmdline(child: int) -> str:
        return Path(f"/proc/{child}/cmdline").read_text().replace("\0", " ")

    return [c for c in children_of(pid) if " replica " in cmdline(c)]


def complete(url: str, model: Path) -> httpx.Response:
    body = {"model": model.name, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_every_replica_killed_comes_back_and_serves(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory()
    launched = up(model, tmp_path, "--max-restarts", "2")
    try:
        url = ready_fields(launched.ready(180))["http"]
        before = complete(url, model).json()["choices"]
        for pid in replicas_of(launched.proc.pid):
            subprocess.run(["kill", "-KILL", str(pid)], check=True)
        end = time.monotonic() + 90
        while launched.stderr.count("is serving again") < 2:
            assert time.monotonic() < end and launched.proc.poll() is None, launched.stderr
            time.sleep(0.2)
        while (answer := complete(url, model)).status_code != 200:  # the router's next liveness poll
            assert time.monotonic() < end, answer.text
            time.sleep(0.3)
        assert answer.json()["choices"] == before
        launched.proc.send_signal(signal.SIGTERM)
        assert launched.wait(60) == 0
    finally:
        launched.kill()


def test_a_spent_restart_budget_stops_the_router_and_exits_1(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    launched = up(tiny_model_factory(), tmp_path, "--max-restarts", "0")
    try:
        launched.ready(180)
        children = children_of(launched.proc.pid)
        victim = replicas_of(launched.proc.pid)[1]
        killed = time.monotonic()
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        assert launched.wait(30) == 1
        assert time.monotonic() - killed < 15
        assert "restart budget (0) spent: stopping the router and every replica" in launched.stderr
        end = time.monotonic() + 15
        while any(alive(c) for c in children):
            assert time.monotonic() < end
            time.sleep(0.1)
    finally:
        launched.kill()


def broken_copy(model: Path, tmp_path: Path, name: str, text: str) -> Path:
    copy = tmp_path / "broken"
    shutil.copytree(model, copy)
    (copy / name).write_text(text)
    return copy


def test_a_replica_that_cannot_load_is_named_with_its_cause(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = broken_copy(tiny_model_factory(), tmp_path, "model.safetensors", "xx")
    launched = up(model, tmp_path)
    assert launched.wait(120) == 1
    lines = launched.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in launched.stderr, launched.stderr
    assert lines[0].startswith("pdcluster up: replica-0-prefill exited with 1: ")
    assert "CheckpointError: cannot read safetensors header" in lines[0] and "(log: " in lines[0]


def test_a_router_that_cannot_start_is_named_with_its_cause(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The HTTP port is free when `up` checks it and taken by the time the router binds it."""
    port = free_port_run(1)
    launched = up(tiny_model_factory(), tmp_path, "--http-port", str(port))
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "logs" / "replica-1-decode.log").exists():  # the check is behind us
            assert time.monotonic() < end, launched.stderr
            time.sleep(0.05)
        with socket.socket() as taker:
            taker.bind(("127.0.0.1", port))
            taker.listen(1)
            assert launched.wait(120) == 1
        lines = launched.stderr.splitlines()
        assert len(lines) == 1 and "Traceback" not in launched.stderr, launched.stderr
        assert lines[0].startswith(
            f"pdcluster up: router exited with 2: pdcluster router: port {port} on "
            "127.0.0.1 is already in use (--http-port) (log: "
        )
    finally:
        launched.kill()
