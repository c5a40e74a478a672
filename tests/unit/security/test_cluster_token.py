"""The replica's cluster token: which RPCs need it, how it is compared, how it is read; the TLS file
checks and the loopback test behind the plaintext warning (replica and router sides)."""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdcluster.cli.main import Refused, parse
from pdcluster.cluster.local import LocalCluster, UpConfig
from replica.config import ReplicaConfig
from replica.server.rpcs import RPCS, SERVICE
from replica.server.security import (
    TOKEN_KEY,
    TlsFiles,
    TokenInterceptor,
    is_loopback,
    read_token,
    warn_if_exposed,
)
from router import security as router_security
from router.config import RouterConfig


@dataclass
class Details:
    """What grpc hands a server interceptor."""

    method: str
    invocation_metadata: Sequence[tuple[str, str | bytes]] = ()


PASSED = object()


def intercept(method: str, *metadata: tuple[str, str | bytes]) -> object:
    return TokenInterceptor("s3cret").intercept_service(lambda details: PASSED, Details(method, metadata))


@pytest.mark.parametrize("name", sorted(set(RPCS) - {"Health", "Info", "ServiceDiscovery"}))
def test_every_state_changing_rpc_needs_the_token(name: str) -> None:
    method = f"/{SERVICE}/{name}"
    assert intercept(method, (TOKEN_KEY, "s3cret")) is PASSED
    assert intercept(method, ("x-other", "v"), (TOKEN_KEY, "s3cret")) is PASSED
    for metadata in ((), ((TOKEN_KEY, "wrong"),), ((TOKEN_KEY, "s3cret2"),), ((TOKEN_KEY, ""),),
                     (("x-admin-token", "s3cret"),)):
        assert intercept(method, *metadata) is not PASSED, metadata


@pytest.mark.parametrize("method", [
    f"/{SERVICE}/Health", f"/{SERVICE}/Info", f"/{SERVICE}/ServiceDiscovery", "/grpc.health.v1.Health/Check",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"])
def test_probes_and_reflection_stay_open(method: str) -> None:
    assert intercept(method) is PASSED


def test_the_refusal_is_unauthenticated_and_runs_nothing() -> None:
    class Context:
        def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(code, details)

    handler = intercept(f"/{SERVICE}/ClearCache", (TOKEN_KEY, "nope"))
    with pytest.raises(RuntimeError) as refused:
        handler.unary_unary(b"", Context())  # type: ignore[attr-defined]
    assert refused.value.args == (grpc.StatusCode.UNAUTHENTICATED, f"wrong or missing {TOKEN_KEY} metadata")


@pytest.mark.parametrize("read", [read_token, router_security.read_token])
def test_reading_the_token(tmp_path: Path, read: Callable[[str, Path | None], str]) -> None:
    file = tmp_path / "token"
    file.write_text("abc-123\n")
    assert read("", None) == ""
    assert read("t0k", None) == "t0k"
    assert read("", file) == "abc-123"
    file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read("", file)
    with pytest.raises(ValueError, match="printable ASCII"):
        read("two words", None)
    with pytest.raises(FileNotFoundError):
        read("", tmp_path / "missing")


def test_token_and_tls_flags_are_checked_by_the_configs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        ReplicaConfig(model=tmp_path, port=0, cluster_token="a", cluster_token_file=tmp_path / "t")
    with pytest.raises(ValueError, match="go together"):
        ReplicaConfig(model=tmp_path, port=0, tls_cert=tmp_path / "c")
    with pytest.raises(ValueError, match="needs --tls-cert"):
        ReplicaConfig(model=tmp_path, port=0, tls_client_ca=tmp_path / "ca")
    with pytest.raises(ValueError, match="go together"):
        RouterConfig(model=tmp_path, tls_key=tmp_path / "k")
    with pytest.raises(ValueError, match="not both"):
        RouterConfig(model=tmp_path, cluster_token="a", cluster_token_file=tmp_path / "t")
    with pytest.raises(ValueError, match="does not exist"):
        TlsFiles(tmp_path / "c.crt", tmp_path / "c.key")
    with pytest.raises(ValueError, match="does not exist"):
        RouterConfig(model=tmp_path, tls_ca=tmp_path / "ca.crt").tls()
    assert TlsFiles().channel_credentials() is None and not TlsFiles().serves


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("10.1.2.3", False), ("::", False), ("node-1", False)])
def test_which_addresses_warn_without_tls(host: str, loopback: bool, caplog: pytest.LogCaptureFixture
                                          ) -> None:
    assert is_loopback(host) is loopback
    log = logging.getLogger("test-security")
    router_security.warn_if_exposed(log, host, tls=False)
    router_security.warn_if_exposed(log, host, tls=True)
    warn_if_exposed(log, "the replica's gRPC server", host, tls=False)
    warn_if_exposed(log, "the replica's gRPC server", host, tls=True)
    assert len(caplog.records) == (0 if loopback else 2)
    assert all("without TLS" in record.getMessage() for record in caplog.records)


def test_the_commands_take_the_flags(tmp_path: Path) -> None:
    files = ["--tls-cert", "c.crt", "--tls-key", "c.key", "--tls-ca", "ca.crt", "--tls-client-ca", "ca.crt"]
    replica = parse(["replica", "--model", "/m", "--port", "0", *files, "--cluster-token-file", "t"])
    assert isinstance(replica, ReplicaConfig)
    assert (replica.tls_cert, replica.tls_client_ca, replica.cluster_token_file) == (
        Path("c.crt"), Path("ca.crt"), Path("t"))
    router = parse(["router", "--model", "/m", *files, "--cluster-token", "abc"])
    assert isinstance(router, RouterConfig)
    assert router.cluster_token == "abc" and router.tls_ca == Path("ca.crt")
    up = parse(["up", "--model", str(tmp_path), *files, "--cluster-token", "abc"])
    assert isinstance(up, UpConfig)
    assert up.tls_args() == [arg if arg.startswith("--") else str(Path(arg).resolve()) for arg in files]
    refused = parse(["up", "--model", str(tmp_path), "--tls-cert", "c.crt", "--tls-key", "c.key"])
    assert isinstance(refused, Refused) and "--tls-ca" in refused.reason


def test_pdcluster_up_hands_the_token_over_in_an_owner_only_file(tmp_path: Path) -> None:
    cluster = LocalCluster(UpConfig(model=tmp_path, cluster_token="s3cret", log_dir=tmp_path / "logs"))
    flag, path = cluster._token_args()
    assert flag == "--cluster-token-file" and Path(path).read_text().strip() == "s3cret"
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    assert LocalCluster(UpConfig(model=tmp_path, log_dir=tmp_path / "l2"))._token_args() == []
