"""TLS and the cluster token of a replica's gRPC edge.

```
 client ══TLS (--tls-cert/--tls-key; client cert required with --tls-client-ca)══► GrpcServer
          x-cluster-token: T ──► TokenInterceptor ── Health, Info, ServiceDiscovery,
                                                     grpc.health.v1, reflection: always let through
                                                   ── any other RPC: T must equal --cluster-token,
                                                      else UNAUTHENTICATED before any handler runs
 replica ══TLS (verified with --tls-ca; our cert as client cert)══► router admin (registration)
```
Plaintext stays the default; `warn_if_exposed` logs a warning when a server binds a non-loopback
address without TLS. The token is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from replica.server.rpcs import SERVICE

TOKEN_KEY = "x-cluster-token"
# RPCs that change nothing: open to anyone who can reach the port (probes, grpcurl list/describe).
OPEN_METHODS = frozenset(f"/{SERVICE}/{name}" for name in ("Health", "Info", "ServiceDiscovery"))
OPEN_SERVICES = ("/grpc.health.v1.", "/grpc.reflection.")


def read_token(token: str, token_file: Path | None) -> str:
    """The cluster token from `--cluster-token` or `--cluster-token-file` ('' = none); ValueError if
    both are given, the file is empty, or the token is not printable ASCII without spaces (it travels
    as gRPC metadata)."""
    if token and token_file is not None:
        raise ValueError("give --cluster-token or --cluster-token-file, not both")
    if token_file is not None:
        token = token_file.read_text().strip()
        if not token:
            raise ValueError(f"the cluster token file {token_file} is empty")
    if token and not (token.isascii() and token.isprintable() and " " not in token):
        raise ValueError("the cluster token must be printable ASCII without spaces")
    return token


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one process: its certificate and key, the CA it trusts as a client (`ca`), and
    the CA its servers require client certificates from (`client_ca`; None = no mutual TLS)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    client_ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.client_ca is not None and self.cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        for path in (self.cert, self.key, self.ca, self.client_ca):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")

    @property
    def serves(self) -> bool:
        """Whether this process's servers speak TLS."""
        return self.cert is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials of a TLS server (client certificates required when `client_ca` is set)."""
        assert self.cert is not None and self.key is not None
        client_ca = self.client_ca.read_bytes() if self.client_ca is not None else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())], root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials of a TLS client (verifying with `ca`, presenting our certificate); None
        (plaintext) without `ca`."""
        if self.ca is None:
            return None
        key = self.key.read_bytes() if self.key is not None else None  # both or neither: __post_init__
        chain = self.cert.read_bytes() if self.cert is not None else None
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), private_key=key, certificate_chain=chain)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address to bind) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(log: logging.Logger, what: str, host: str, tls: bool) -> None:
    """Log a warning when `what` binds a non-loopback `host` in plaintext."""
    if not tls and not is_loopback(host):
        log.warning("%s listens on %s without TLS: anyone on the network can read and send its calls "
                    "(--tls-cert/--tls-key; `pdcluster make-certs`)", what, host)


def _unauthenticated(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, f"wrong or missing {TOKEN_KEY} metadata")


class TokenInterceptor(grpc.ServerInterceptor):
    """Every RPC but the open ones needs `x-cluster-token` equal to the replica's cluster token."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenInterceptor needs a token")
        self._token = token.encode()
        self._deny = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if method in OPEN_METHODS or method.startswith(OPEN_SERVICES) or self._allowed(details):
            return continuation(details)
        return self._deny

    def _allowed(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._token)
        return False
