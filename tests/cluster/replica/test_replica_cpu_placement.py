"""`pdcluster replica --engine-cpus`: the engine thread alone on its core, every other thread of the
replica and of its front process on the rest, and a core it may not use refused at start."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from pdcluster.cluster.replica_process import REPO, ReplicaProcess
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc

DEADLINE = 30.0
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _thread_cores(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores to give the engine one of its own")
def test_engine_thread_alone_on_its_core(tiny_model_factory: Callable[..., Path]) -> None:
    engine, rest = {CORES[-1]}, set(CORES[:-1])
    model = tiny_model_factory(arch="llama")
    with ReplicaProcess.start(model, "--num-blocks", "16", "--engine-cpus", str(CORES[-1])) as replica:
        threads = _thread_cores(replica.process.pid)
        assert threads.count(engine) == 1  # the engine thread (one torch thread: no intra-op pool)
        assert all(cores == rest for cores in threads if cores != engine)
        pid = replica.process.pid
        (front,) = map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
        assert all(cores == rest for cores in _thread_cores(front))
        with grpc.insecure_channel(replica.address) as channel:  # and it serves
            stub = pb_grpc.TextGenerationServiceStub(channel)
            stopping = pb.StoppingCriteriaParameters(max_new_tokens=4, ignore_eos_token=True)
            request = pb.Request(id=0, input_tokens=[5, 6, 7], stopping_parameters=stopping)
            batch = pb.Batch(id=1, size=1, requests=[request])
            cached = stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=DEADLINE).batch
            response = stub.DecodeV2(pb.DecodeV2Request(batches=[cached]), timeout=DEADLINE)
            assert len(response.generations) == 1
        # still alone after forwards: oneDNN's matmuls take the engine thread's one torch thread
        assert _thread_cores(replica.process.pid).count(engine) == 1
        assert replica.stop() == 0


@pytest.mark.skipif(not CORES, reason="thread affinity is Linux-only")
def test_a_core_it_may_not_use_is_refused(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory(arch="llama")
    missing = max(CORES) + 1
    cmd = [sys.executable, "-m", "pdcluster", "replica", "--model", str(model), "--port", "0",
           "--engine-cpus", str(missing)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=DEADLINE)
    assert done.returncode == 2
    assert f"--engine-cpus [{missing}] not among the cores this process may use" in done.stderr
    assert "serving on" not in done.stdout
