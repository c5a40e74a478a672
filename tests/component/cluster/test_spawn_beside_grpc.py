"""Children spawned by `pdcluster.cluster.processes` from a process that uses gRPC all start, and die
with their parent, also when it is killed."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster.cluster.processes import spawn
from tests.helpers.processes import alive


def test_two_hundred_children_of_a_grpc_process_all_exec(tmp_path: Path) -> None:
    """Regression: spawned with a preexec_fn (fork), about 2 % of them aborted in gRPC's fork handler
    before exec (exit -6, "epoll_wait error: Bad file descriptor"), failing a cluster's start."""
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def busy() -> None:  # keep gRPC's threads at work while we spawn
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    try:
        codes = [
            spawn(
                f"c{i}", "test", ["true"], tmp_path / "c.log", cpus=frozenset({0}) if i % 2 else None
            ).popen.wait(10)
            for i in range(200)
        ]
    finally:
        stop.set()
        worker.join(10)
        server.stop(0)
    assert codes == [0] * 200, (sorted(set(codes)), (tmp_path / "c.log").read_text()[-500:])


def test_a_child_dies_when_its_parent_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from pdcluster.cluster.processes import spawn; "
            f"p = spawn('s', 'test', ['sleep', '60'], Path({str(tmp_path / 's.log')!r})); "
            "print(p.popen.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    end = time.monotonic() + 10
    # the wrapper sets the parent-death signal, then execs: kill the parent only once it has (the
    # wrapper's own command line names `sleep` too, so look at the program, argv[0])
    while Path(f"/proc/{child}/cmdline").read_text().split("\0")[0] != "sleep":
        assert time.monotonic() < end and alive(child)
        time.sleep(0.01)
    parent.kill()
    parent.wait(10)
    end = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < end, "the child outlived its killed parent"
        time.sleep(0.05)
