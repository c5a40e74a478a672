"""`pdcluster make-certs DIR`: a private CA and one certificate per host (and per client) for TLS.

```
 DIR/ca.crt  DIR/ca.key            the cluster's CA (made once; reused when DIR already holds one)
 DIR/HOST.crt  DIR/HOST.key        one per --host / --hosts-file / --ranks host: its name (DNS or IP)
                                   as subjectAltName, serverAuth + clientAuth (a replica serves and
                                   registers; the router serves and calls replicas)
 DIR/NAME.crt  DIR/NAME.key        one per --client: clientAuth only (grpcurl, curl, the openai client
                                   under mutual TLS)
```
Keys are ECDSA P-256, written owner-read-only (0600). Every process gets `--tls-cert DIR/HOST.crt
--tls-key DIR/HOST.key --tls-ca DIR/ca.crt` (and `--tls-client-ca DIR/ca.crt` for mutual TLS);
clients verify with `ca.crt` (`grpcurl -cacert DIR/ca.crt`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_CA_DAYS = 3650


@dataclass
class MakeCertsConfig:
    """Flags of `pdcluster make-certs`."""

    out: Path = field(metadata={"help": "folder to write the CA and the certificates into",
                                "positional": True})
    host: list[str] = field(default_factory=list, metadata={
        "help": "host names or IP addresses to issue a certificate for (`--host A B ...`)"})
    hosts_file: Path | None = field(default=None, metadata={
        "help": "a file of host names or IP addresses, one per line (# comments)"})
    ranks: Path | None = field(default=None, metadata={
        "help": "a rank table (the replicas' --cluster file): a certificate for each of its hosts"})
    client: list[str] = field(default_factory=lambda: ["client"], metadata={
        "help": "names of client-only certificates (for tools under mutual TLS)"})
    days: int = field(default=365, metadata={"help": "validity of the host and client certificates, days"})

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.days < 1:
            raise ValueError(f"--days must be >= 1, got {self.days}")
        for name in self.client:
            check_name(name)
        for host in self.host:
            check_name(host)


def check_name(name: str) -> str:
    """`name` if it is an IP address or a DNS name (it names files in DIR), else ValueError."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    if name == "ca" or not _DNS_NAME.match(name):
        raise ValueError(f"{name!r} is not a host name or IP address (nor may it be 'ca')")
    return name


def hosts_of(config: MakeCertsConfig) -> list[str]:
    """Every host named by the flags, each once, in order."""
    hosts = list(config.host)
    if config.hosts_file is not None:
        for line in config.hosts_file.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                hosts.append(check_name(line))
    if config.ranks is not None:
        from transfer.ranktable import load_rank_table

        hosts += [check_name(entry.host) for entry in load_rank_table(config.ranks)]
    return list(dict.fromkeys(hosts))


@dataclass(frozen=True)
class Authority:
    """The CA: its key and certificate."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, now: datetime.datetime) -> Authority:
        """A new self-signed CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdcluster CA")])
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            _builder(name, name, key.public_key(), now, _CA_DAYS)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(cert_sign=True), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load(cls, folder: Path) -> Authority:
        """The CA already in `folder` (ca.crt + ca.key)."""
        key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{folder / 'ca.key'} is not an EC key")
        return cls(key, x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes()))

    def issue(self, name: str, server: bool, now: datetime.datetime, days: int
              ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        """A key and a certificate for `name` (subjectAltName: `name`, as an IP address or DNS name)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else [
            ExtendedKeyUsageOID.CLIENT_AUTH]
        ca_ski = self.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (
            _builder(subject, self.cert.subject, key.public_key(), now, days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName([_general_name(name)]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                           critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return key, cert


def _builder(subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey,
             now: datetime.datetime, days: int) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
        encipher_only=False, decipher_only=False,
    )


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_certs(config: MakeCertsConfig) -> list[Path]:
    """Write the CA (unless `out` has one) and a certificate per host and client; returns the .crt paths."""
    hosts = hosts_of(config)
    if not hosts and not config.client:
        raise ValueError("nothing to issue: give --host, --hosts-file, --ranks or --client")
    config.out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    if (config.out / "ca.crt").exists() and (config.out / "ca.key").exists():
        ca = Authority.load(config.out)
    else:
        ca = Authority.create(now)
        _write_key(config.out / "ca.key", ca.key)
        _write_cert(config.out / "ca.crt", ca.cert)
    written = [config.out / "ca.crt"]
    for name, server in [*((h, True) for h in hosts), *((c, False) for c in config.client)]:
        key, cert = ca.issue(name, server, now, config.days)
        _write_key(config.out / f"{name}.key", key)
        _write_cert(config.out / f"{name}.crt", cert)
        written.append(config.out / f"{name}.crt")
    return written


def run(config: MakeCertsConfig) -> int:
    """Entry point of `pdcluster make-certs`: prints each certificate written; 2 on bad input."""
    try:
        written = make_certs(config)
    except (ValueError, OSError) as exc:
        print(f"pdcluster make-certs: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
