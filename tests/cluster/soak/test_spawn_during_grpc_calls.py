"""Children spawned while other threads of this process are in gRPC calls all start, and still die
with their parent. With a `preexec_fn` (fork + gRPC's fork handlers) a few in a hundred aborted
before exec (exit -6, `epoll_wait error: Bad file descriptor`): the soak's restarted replica did."""

from __future__ import annotations

import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster.cluster.processes import spawn


def test_spawned_children_start_while_grpc_calls_run(tmp_path: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)

    probes = [threading.Thread(target=probe) for _ in range(2)]
    for thread in probes:
        thread.start()
    try:
        codes = [spawn(f"c{i}", "test", ["true"], tmp_path / f"c{i}.log").popen.wait(30) for i in range(100)]
    finally:
        stop.set()
        for thread in probes:
            thread.join(30)
        server.stop(None)
    assert codes == [0] * 100


def test_a_child_dies_with_the_thread_that_spawned_it(tmp_path: Path) -> None:
    started: list[int] = []
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]

    def parent() -> None:
        proc = spawn("sleeper", "test", sleeper, tmp_path / "sleeper.log")
        proc.wait_line("up", time.monotonic() + 30)
        started.append(proc.popen.pid)

    thread = threading.Thread(target=parent)
    thread.start()
    thread.join(60)
    (pid,) = started
    end = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.monotonic() < end, "the child outlived the thread that spawned it"
        time.sleep(0.1)
