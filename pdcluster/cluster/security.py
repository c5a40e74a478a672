"""TLS and the cluster token of a launch: which files each process gets, and where.

```
 [tls] certs = "DIR" (pdcluster make-certs DIR --host A B ROUTER), mutual = true|false
 [cluster] token_file = "PATH"
   this machine: router ── --tls-cert DIR/ROUTER.crt --tls-key DIR/ROUTER.key --tls-ca DIR/ca.crt
                           [--tls-client-ca DIR/ca.crt] --cluster-token-file PATH
   node A ◄── staged (stdin, owner-only): ca.crt, A.crt, A.key, cluster-token in /tmp/pdcluster-RUN/
          replica ── --tls-cert RUN/A.crt --tls-key RUN/A.key --tls-ca RUN/ca.crt [--tls-client-ca …]
                     --cluster-token-file RUN/cluster-token
```
A replica's certificate is the one issued for its node's `address` (the name the router dials); a
node receives only its own key. The token never appears on a command line. The checks of
`check_files` run when the cluster file is parsed, before anything starts; `bundle` packs a node's
files for the stage script (`launch_plan.Commands.stage_script`).
"""

from __future__ import annotations

import base64
import io
import ipaddress
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from router.security import read_token

TOKEN_NAME = "cluster-token"  # the staged token file's name in the node folder
CA_NAME = "ca.crt"

Where = tuple[str | int, ...]  # a key path of the cluster file (its line is named in errors)


@dataclass(frozen=True)
class Security:
    """`[tls]` and `[cluster] token_file` of a cluster file (both optional)."""

    certs: Path | None = None  # the folder `pdcluster make-certs` wrote; None: no TLS
    mutual: bool = False  # servers require client certificates signed by the CA (HTTPS port too)
    router_name: str = ""  # the router's certificate name; default: [router] host
    client: str = "client"  # the client certificate `pdcluster status` presents under mutual TLS
    token_file: Path | None = None  # the replicas' cluster token; None: no token

    @property
    def tls(self) -> bool:
        """Whether every process speaks TLS."""
        return self.certs is not None

    def local(self, name: str) -> Path:
        """A file of the certificate folder on this machine."""
        return (self.certs or Path()) / name

    def tls_args(self, cert: str, key: str, ca: str) -> list[str]:
        """The TLS flags of one process, given where its files are."""
        if not self.tls:
            return []
        args = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
        return [*args, "--tls-client-ca", ca] if self.mutual else args

    def replica_args(self, address: str, node_dir: PurePosixPath) -> list[str]:
        """TLS and token flags of a replica on the node reached at `address` (its staged files)."""
        args = self.tls_args(str(node_dir / f"{address}.crt"), str(node_dir / f"{address}.key"),
                             str(node_dir / CA_NAME))
        if self.token_file is not None:
            args += ["--cluster-token-file", str(node_dir / TOKEN_NAME)]
        return args

    def router_args(self, router_host: str) -> list[str]:
        """TLS and token flags of the router (it runs here: the files where they are)."""
        name = self.router_name or router_host
        args = self.tls_args(str(self.local(f"{name}.crt")), str(self.local(f"{name}.key")),
                             str(self.local(CA_NAME))) if self.tls else []
        if self.token_file is not None:
            args += ["--cluster-token-file", str(self.token_file)]
        return args

    def node_files(self, address: str) -> dict[str, Path]:
        """What is staged on the node reached at `address`: name in its run folder -> file here."""
        files: dict[str, Path] = {}
        if self.tls:
            files |= {CA_NAME: self.local(CA_NAME), f"{address}.crt": self.local(f"{address}.crt"),
                      f"{address}.key": self.local(f"{address}.key")}
        if self.token_file is not None:
            files[TOKEN_NAME] = self.token_file
        return files


def is_wildcard(host: str) -> bool:
    """Whether `host` is an address that binds every interface (no certificate can name it)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


Error = Callable[[Where, str], Exception]


def check_files(security: Security, nodes: Iterable[tuple[int, str]], router_host: str, error: Error) -> None:
    """Every file the launch will hand out exists and reads (the token parses), before anything starts.

    `nodes`: (index, address) of every node; `error(where, message)` makes the exception to raise.
    """
    if security.token_file is not None:
        try:
            read_token("", security.token_file)
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise error(("cluster", "token_file"),
                        f"cluster.token_file {security.token_file}: {why}") from None
    if security.certs is None:
        return
    certs = security.certs
    hint = f"`pdcluster make-certs {certs} --host HOST …`"
    if not certs.is_dir():
        raise error(("tls", "certs"), f"tls.certs: no folder {certs} (make one with {hint})")
    if not (certs / CA_NAME).is_file():
        raise error(("tls", "certs"), f"tls.certs: no {CA_NAME} in {certs} (made by {hint})")
    for index, address in nodes:
        _pair(certs, address, ("nodes", index, "address"), f"nodes[{index}] ({address})", error)
    if not security.router_name and is_wildcard(router_host):
        raise error(("router", "host"), f"router.host {router_host} binds every interface: with [tls] set "
                                        "tls.router_name = the name clients reach the router by")
    name = security.router_name or router_host
    where: Where = ("tls", "router_name") if security.router_name else ("router", "host")
    _pair(certs, name, where, f"the router ({name})", error)
    if security.mutual:
        _pair(certs, security.client, ("tls", "client"),
              f"`pdcluster status` under mutual TLS (client {security.client!r})", error, "--client")


def _pair(certs: Path, name: str, where: Where, whose: str, error: Error, flag: str = "--host") -> None:
    for suffix in (".crt", ".key"):
        path = certs / f"{name}{suffix}"
        try:
            path.read_bytes()
        except OSError as exc:
            raise error(where, f"{whose} needs {path}: {exc.strerror or exc} (make it with "
                               f"`pdcluster make-certs {certs} {flag} {name}`)") from None


def bundle(files: dict[str, bytes]) -> str:
    """`files` (name -> contents) as base64 text of a tar archive, owner-only modes: the stage script's
    stdin (`base64 -d | tar -x`)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o600
            tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(out.getvalue()).decode("ascii")
