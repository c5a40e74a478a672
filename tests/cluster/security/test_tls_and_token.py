"""A local cluster with mutual TLS on every port and a cluster token on its replicas (`pdcluster up
--tls-cert/--tls-key/--tls-ca/--tls-client-ca --cluster-token`), driven by the openai client over
HTTPS, grpcurl with `-cacert`, a gRPC stub, the router's own replica client, and a replica that
registers itself over TLS. Without a client certificate nothing gets through; without the right
token a state-changing replica call gets UNAUTHENTICATED and changes nothing.

The tests share one cluster (module fixture) and run in file order.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from pdcluster.cluster.local import LocalCluster, UpConfig
from pdcluster.cluster.replica_process import ReplicaProcess
from pdcluster.tools.certs import MakeCertsConfig, make_certs
from protos import generate_pb2 as pb
from protos import generate_pb2_grpc as pb_grpc
from router.client import ReplicaClient, channel_credentials
from router.errors import ReplicaRejected, ReplicaUnavailable
from router.security import RouterTls

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
TOKEN = "cluster-s3cret"
ADMIN_TOKEN = "admin-s3cret"
DEADLINE = 60.0
SERVICE = "generate.v2.TextGenerationService"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_certs(MakeCertsConfig(out=out, host=["127.0.0.1"], client=["client"]))
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="module")
def cluster(certs: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = UpConfig(
        model=model_dir, prefill=1, decode=1, http_port=0, admin_port=0, num_blocks=64,
        admin_token=ADMIN_TOKEN, log_dir=tmp_path_factory.mktemp("logs"), ready_timeout=180,
        tls_cert=certs / "127.0.0.1.crt", tls_key=certs / "127.0.0.1.key", tls_ca=certs / "ca.crt",
        tls_client_ca=certs / "ca.crt", cluster_token=TOKEN,
    )
    with LocalCluster(config) as running:
        yield running


def client_context(certs: Path, with_cert: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if with_cert:
        context.load_cert_chain(str(certs / "client.crt"), str(certs / "client.key"))
    return context


def credentials(certs: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials((certs / "ca.crt").read_bytes(), (certs / "client.key").read_bytes(),
                                        (certs / "client.crt").read_bytes())


def grpcurl(certs: Path, address: str, *args: str, client_cert: bool = True
            ) -> subprocess.CompletedProcess[str]:
    tls = ["-cacert", str(certs / "ca.crt")]
    if client_cert:
        tls += ["-cert", str(certs / "client.crt"), "-key", str(certs / "client.key")]
    else:  # the handshake fails: do not let grpcurl retry it for its default 10 s
        tls += ["-connect-timeout", "3"]
    return subprocess.run([GRPCURL, "-max-time", "30", *tls, *args[:-1], address, args[-1]],
                          capture_output=True, text=True, timeout=60)


def test_openai_client_over_https(cluster: LocalCluster, certs: Path, model_dir: Path) -> None:
    assert cluster.http_url.startswith("https://127.0.0.1:")
    with openai.DefaultHttpxClient(verify=client_context(certs), timeout=120) as http:
        client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", http_client=http)
        answer = client.completions.create(model=model_dir.name, prompt="hello there", max_tokens=5,
                                           temperature=0)
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    assert answer.choices[0].finish_reason in ("length", "stop")


def test_https_refuses_a_client_without_certificate_or_tls(cluster: LocalCluster, certs: Path) -> None:
    # refused in the TLS handshake (or on the first read, under TLS 1.3): no HTTP answer at all
    with httpx.Client(verify=client_context(certs, with_cert=False), timeout=30) as http, \
            pytest.raises(httpx.TransportError):
        http.get(f"{cluster.http_url}/health")
    plain = cluster.http_url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plain}/health", timeout=30)
    with httpx.Client(verify=client_context(certs), timeout=30) as http:
        assert http.get(f"{cluster.http_url}/health").status_code == 200


def test_grpcurl_with_cacert_against_a_replica_and_the_admin(cluster: LocalCluster, certs: Path) -> None:
    replica = cluster.replicas[0].address
    listed = grpcurl(certs, replica, "list")
    assert listed.returncode == 0, listed.stderr
    assert SERVICE in listed.stdout.split()
    info = grpcurl(certs, replica, f"{SERVICE}/Info")  # open: no token needed
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["num_blocks_total"] == 64
    refused = grpcurl(certs, replica, f"{SERVICE}/ClearCache")
    assert refused.returncode != 0 and "Unauthenticated" in refused.stdout + refused.stderr
    cleared = grpcurl(certs, replica, "-H", f"x-cluster-token: {TOKEN}", f"{SERVICE}/ClearCache")
    assert cleared.returncode == 0, cleared.stderr
    no_cert = grpcurl(certs, replica, "list", client_cert=False)
    assert no_cert.returncode != 0
    admin = grpcurl(certs, cluster.admin_address, "router.v1.RouterAdmin/ListReplicas")
    assert admin.returncode == 0, admin.stderr
    assert len(json.loads(admin.stdout)["replicas"]) == 2
    assert grpcurl(certs, cluster.admin_address, "list", client_cert=False).returncode != 0


def test_wrong_or_missing_token_is_unauthenticated_and_changes_nothing(cluster: LocalCluster, certs: Path
                                                                       ) -> None:
    with grpc.secure_channel(cluster.replicas[1].address, credentials(certs)) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        good = (("x-cluster-token", TOKEN),)
        request = pb.Request(id=7, input_tokens=list(range(3, 40)),
                             stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=4))
        batch = pb.Batch(id=10**9, requests=[request], size=1)
        stub.PrefillV2(pb.PrefillV2Request(batch=batch, forward_case=pb.NORMAL), timeout=DEADLINE,
                       metadata=good)
        before = stub.Info(pb.InfoRequest(), timeout=DEADLINE)
        assert before.num_blocks_free < before.num_blocks_total and before.num_cached_batches >= 1
        calls = [
            lambda md: stub.ClearCache(pb.ClearCacheRequest(id=10**9), timeout=DEADLINE, metadata=md),
            lambda md: stub.ClearCache(pb.ClearCacheRequest(), timeout=DEADLINE, metadata=md),
            lambda md: stub.PrefillV2(pb.PrefillV2Request(batch=pb.Batch(id=10**9 + 1, requests=[request])),
                                      timeout=DEADLINE, metadata=md),
            lambda md: stub.ResetStatus(pb.ResetStatusRequest(), timeout=DEADLINE, metadata=md),
            lambda md: stub.FilterBatch(pb.FilterBatchRequest(batch_id=10**9), timeout=DEADLINE, metadata=md),
        ]
        for call in calls:
            for metadata in ((), (("x-cluster-token", "wrong"),), (("x-admin-token", TOKEN),)):
                with pytest.raises(grpc.RpcError) as refused:
                    call(metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        after = stub.Info(pb.InfoRequest(), timeout=DEADLINE)
        assert after == before
        stub.ClearCache(pb.ClearCacheRequest(id=10**9), timeout=DEADLINE, metadata=good)
        cleared = stub.Info(pb.InfoRequest(), timeout=DEADLINE)
        assert cleared.num_blocks_free == cleared.num_blocks_total


def test_the_routers_replica_client(cluster: LocalCluster, certs: Path) -> None:
    tls = RouterTls(cert=certs / "client.crt", key=certs / "client.key", ca=certs / "ca.crt")
    address = cluster.replicas[0].address

    async def run() -> None:
        right = ReplicaClient(address, 30.0, 30.0, channel_credentials(tls), TOKEN)
        wrong = ReplicaClient(address, 30.0, 30.0, channel_credentials(tls), "wrong")
        only_ca = channel_credentials(RouterTls(ca=certs / "ca.crt"))
        no_cert = ReplicaClient(address, 30.0, 30.0, only_ca, TOKEN)
        plain = ReplicaClient(address, 30.0, 30.0, None, TOKEN)
        try:
            assert (await right.info()).num_blocks_total == 64
            await right.clear_cache()
            assert (await wrong.info()).num_blocks_total == 64  # Info is open
            with pytest.raises(ReplicaRejected) as refused:
                await wrong.clear_cache()
            assert refused.value.code == "UNAUTHENTICATED"
            for client in (no_cert, plain):
                with pytest.raises(ReplicaUnavailable):
                    await client.info()
        finally:
            for client in (right, wrong, no_cert, plain):
                await client.close()

    asyncio.run(run())


def test_a_replica_registers_over_tls_and_serves_tls_in_process(
    cluster: LocalCluster, certs: Path, model_dir: Path, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    args = ["--num-blocks", "32", "--no-grpc-frontend", "--router", cluster.admin_address,
            "--router-token", ADMIN_TOKEN, "--role", "inactive", "--cluster-token-file", str(token_file),
            "--tls-cert", str(certs / "127.0.0.1.crt"), "--tls-key", str(certs / "127.0.0.1.key"),
            "--tls-ca", str(certs / "ca.crt"), "--tls-client-ca", str(certs / "ca.crt")]
    with ReplicaProcess.start(model_dir, *args, timeout=120):
        end = time.monotonic() + 60
        while True:
            listed = grpcurl(certs, cluster.admin_address, "router.v1.RouterAdmin/ListReplicas")
            replicas = json.loads(listed.stdout or "{}").get("replicas", [])
            if any(r.get("registered") for r in replicas):
                break
            assert time.monotonic() < end, (listed.stdout, listed.stderr)
            time.sleep(0.5)
        registered = [r for r in replicas if r.get("registered")]
        assert [r["role"] for r in registered] == ["REPLICA_ROLE_INACTIVE"]
        address = registered[0]["address"]  # its edge in this process: TLS and the token all the same
        refused = grpcurl(certs, address, f"{SERVICE}/ResetStatus")
        assert refused.returncode != 0 and "Unauthenticated" in refused.stdout + refused.stderr
        assert grpcurl(certs, address, f"{SERVICE}/Health").returncode == 0
        assert grpcurl(certs, address, "list", client_cert=False).returncode != 0
