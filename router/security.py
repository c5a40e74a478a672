"""TLS and the cluster token on the router's side.

```
 clients ══HTTPS (--tls-cert/--tls-key; client cert required with --tls-client-ca)══► HTTP front end
 grpcurl ══TLS (same files)═══════════════════════════════════════════════════════► admin gRPC
 router  ══TLS (replicas verified with --tls-ca; our cert as client cert)══► replicas
          + x-cluster-token: T on every replica call (--cluster-token / --cluster-token-file)
```
The replica has the same rules in `replica/server/security.py`; the router never imports the
replica (they meet over gRPC only), so the few lines that read the files are its own. Pure Python:
the gRPC credentials are built by the edges (`client.channel_credentials`, `admin.server_credentials`).
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKEN_KEY = "x-cluster-token"


def read_token(token: str, token_file: Path | None) -> str:
    """The cluster token from `--cluster-token` or `--cluster-token-file` ('' = none); ValueError if
    the file is empty or the token is not printable ASCII without spaces (it travels as metadata)."""
    if token_file is not None:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"the cluster token file {token_file} is empty")
    if token and not (token.isascii() and token.isprintable() and " " not in token):
        raise ValueError("the cluster token must be printable ASCII without spaces")
    return token


@dataclass(frozen=True)
class RouterTls:
    """PEM files: the router's certificate and key (its HTTPS and admin servers, and its client
    certificate towards replicas), the CA replicas are verified with, and the CA its servers require
    client certificates from (None = no mutual TLS)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    client_ca: Path | None = None

    def __post_init__(self) -> None:
        for path in (self.cert, self.key, self.ca, self.client_ca):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")

    @property
    def serves(self) -> bool:
        """Whether the router's servers speak TLS."""
        return self.cert is not None and self.key is not None

    def key_pair(self) -> tuple[bytes, bytes] | None:
        """(key, certificate chain) PEM of the router's servers and client certificate; None: none."""
        if self.cert is None or self.key is None:
            return None
        return self.key.read_bytes(), self.cert.read_bytes()

    def pem(self, which: Path | None) -> bytes | None:
        """The contents of `self.ca` or `self.client_ca` (None when unset)."""
        return None if which is None else which.read_bytes()

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config keyword arguments of HTTPS (none for plaintext)."""
        if not self.serves:
            return {}
        options: dict[str, Any] = {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}
        if self.client_ca is not None:
            options |= {"ssl_ca_certs": str(self.client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return options


def warn_if_exposed(log: logging.Logger, host: str, tls: bool) -> None:
    """Log a warning when the router binds a non-loopback `host` in plaintext."""
    if tls or host == "localhost":
        return
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return
    except ValueError:
        pass
    log.warning("the router's HTTP and admin servers listen on %s without TLS: anyone on the network can "
                "read and send their requests (--tls-cert/--tls-key; `pdcluster make-certs`)", host)
