"""`pdcluster launch --via local` on two "nodes" of this machine (127.0.0.1 and 127.0.0.2): it serves,
`status` lists it, a killed replica is restarted on its address and taken back by the router, `down`
from another shell leaves no process; a node whose replica cannot start fails the launch naming it
and stops the replica already started on the other; a second launch of a running file is refused;
with `[tls]` (mutual) and `[cluster] token_file` it serves over HTTPS, `status` reaches every
replica and the router over TLS, and a replica refuses a state-changing call without the token."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest

from pdcluster.tools.certs import MakeCertsConfig, make_certs
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from tests.helpers.launched import Launched, NodeLine, pdcluster, ready_fields, write_cluster_file
from tests.helpers.processes import alive, descendants


def cluster_file(tmp_path: Path, model: Path, b_extra: tuple[str, ...] = ()) -> Path:
    nodes = [NodeLine("a", "127.0.0.1", {"prefill": 1}), NodeLine("b", "127.0.0.2", {"decode": 1}, b_extra)]
    return write_cluster_file(
        tmp_path / "cluster.toml", model, nodes, "local", "127.0.0.1", launch=("max_restarts = 2",)
    )


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(pdcluster(*args), capture_output=True, text=True, timeout=120, check=False)


def complete(url: str, model: Path) -> dict[str, object]:
    body = {"model": model.name, "prompt": "hello", "max_tokens": 5, "temperature": 0}
    answer: dict[str, object] = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    return answer


def taken_back(file: Path) -> bool:
    """`status` shows every replica serving, each in its role at the router."""
    rows = [line.split() for line in run("status", str(file)).stdout.splitlines()]
    rows = [row for row in rows if row and row[0].isdigit()]
    return [(row[6], row[7]) for row in rows] == [("SERVING", "prefill"), ("SERVING", "decode")]


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.2)


@pytest.mark.long  # over a minute on 2 cores: the slow tier (`make test-long`, run by CI)
def test_local_launch_status_restart_and_down(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory()
    file = cluster_file(tmp_path, model)
    launched = Launched(pdcluster("launch", str(file)))
    try:
        fields = ready_fields(launched.ready(180))
        assert "prefill@127.0.0.1:" in fields["replicas"] and "decode@127.0.0.2:" in fields["replicas"]
        first = complete(fields["http"], model)
        status = run("status", str(file))
        assert status.returncode == 0 and status.stdout.count("SERVING") == 2, status.stdout
        record = json.loads((tmp_path / "logs" / "run.json").read_text())
        pid = int(Path(record["node_dir"], "replica-1-decode.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: "replica-1-decode on b is serving again" in launched.stderr, 60, launched.stderr)
        # the router polls the address it knows and takes the new process in as the replica: by its
        # missed heartbeats, or (restarted within the deadline) by the new process id its Info gives
        router_log = Path(record["logs"], "router.log")
        taken_in = re.compile(r"replica 1 \(127\.0\.0\.2:\d+\) answers again: back as decode")
        wait_for(lambda: taken_in.search(router_log.read_text()) is not None, 60, router_log.read_text())
        wait_for(lambda: taken_back(file), 60, run("status", str(file)).stdout)
        try:
            again = complete(fields["http"], model)
        except httpx.TimeoutException:
            logs = [router_log, *sorted(Path(record["logs"]).glob("*/*.log"))]
            tails = [f"== {log.name}\n" + "\n".join(log.read_text().splitlines()[-25:]) for log in logs]
            hung = "a request after the restart hung; the logs end:\n"
            raise AssertionError(hung + "\n".join(tails)) from None
        assert again["choices"] == first["choices"]
        status = run("status", str(file))
        assert status.returncode == 0 and status.stdout.splitlines()[-1].split()[-1] == "1"  # one restart
        children = descendants(launched.proc.pid)
        down = run("down", str(file))
        assert down.returncode == 0, down.stderr
        assert launched.wait(60) == 0
        wait_for(lambda: not any(alive(c) for c in children), 20, "children left")
        assert not Path(record["node_dir"]).exists() and run("status", str(file)).returncode == 3
    finally:
        launched.kill()


def test_a_node_that_fails_to_start_is_named_and_the_others_stopped(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    file = cluster_file(tmp_path, tiny_model_factory(), b_extra=('env = { PYTHONHOME = "/nonexistent" }',))
    launched = Launched(pdcluster("launch", str(file)))
    try:
        assert launched.wait(120) == 1
        assert "node b (127.0.0.2) failed to start: replica-1-decode on b exited with 1" in launched.stderr
        record = json.loads((tmp_path / "logs" / "run.json").read_text())
        assert record["phase"] == "failed"
        assert Path(record["logs"], "a", "replica-0-prefill.log").exists()  # a's replica had started
        assert not Path(record["node_dir"]).exists()  # its stop ran there
    finally:
        launched.kill()


def test_a_second_launch_of_a_running_file_is_refused(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    file = cluster_file(tmp_path, tiny_model_factory())
    launched = Launched(pdcluster("launch", str(file)))
    try:
        launched.ready(180)
        second = run("launch", str(file))
        assert second.returncode == 1 and "is already launched" in second.stderr
        assert run("down", str(file)).returncode == 0 and launched.wait(60) == 0
    finally:
        launched.kill()


def test_tls_and_token_launch_serves_over_https_and_replicas_want_the_token(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory()
    certs = tmp_path / "certs"
    make_certs(MakeCertsConfig(out=certs, host=["127.0.0.1", "127.0.0.2"], client=["client"]))
    (tmp_path / "token").write_text("launch-s3cret\n")
    file = cluster_file(tmp_path, model)
    file.write_text(
        file.read_text() + '\n[tls]\ncerts = "certs"\nmutual = true\n[cluster]\ntoken_file = "token"\n'
    )
    launched = Launched(pdcluster("launch", str(file)))
    try:
        fields = ready_fields(launched.ready(180))
        assert fields["http"].startswith("https://127.0.0.1:"), fields
        context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        context.load_cert_chain(str(certs / "client.crt"), str(certs / "client.key"))
        body = {"model": model.name, "prompt": "hello", "max_tokens": 5, "temperature": 0}
        with httpx.Client(verify=context, timeout=60) as http:
            answer = http.post(f"{fields['http']}/v1/completions", json=body)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
        with pytest.raises(httpx.TransportError):  # plain HTTP gets nothing
            httpx.get(fields["http"].replace("https://", "http://") + "/health", timeout=30)
        status = run("status", str(file))
        assert status.returncode == 0 and status.stdout.count("SERVING") == 2, status.stdout
        assert taken_back(file) and "(answering)" in status.stdout, status.stdout
        record = json.loads((tmp_path / "logs" / "run.json").read_text())
        credentials = grpc.ssl_channel_credentials(
            (certs / "ca.crt").read_bytes(),
            (certs / "client.key").read_bytes(),
            (certs / "client.crt").read_bytes(),
        )
        with grpc.secure_channel(record["replicas"][1]["address"], credentials) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ClearCache(pb.ClearCacheRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as passed:  # with the token: past the check, no such batch
                stub.ClearCache(
                    pb.ClearCacheRequest(id=10**9),
                    timeout=30,
                    metadata=[("x-cluster-token", "launch-s3cret")],
                )
            assert passed.value.code() == grpc.StatusCode.NOT_FOUND, passed.value.details()
        staged = Path(record["node_dir"])
        assert stat.S_IMODE((staged / "127.0.0.2.key").stat().st_mode) == 0o600
        down = run("down", str(file))
        assert down.returncode == 0, down.stderr
        assert launched.wait(60) == 0 and not staged.exists()
    finally:
        launched.kill()
