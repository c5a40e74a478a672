"""`pdcluster make-certs`: a CA, host certificates that verify against it with the host as
subjectAltName, owner-only keys, the CA reused on a second run, and bad input refused."""

from __future__ import annotations

import ipaddress
import json
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdcluster.cli import main
from pdcluster.cli.main import Refused, parse
from pdcluster.tools.certs import MakeCertsConfig, make_certs


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def alt_names(path: Path, kind: type[x509.GeneralName]) -> list[object]:
    return list(load(path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                .get_values_for_type(kind))  # type: ignore[arg-type]


def test_hosts_and_clients_are_signed_by_the_ca(tmp_path: Path) -> None:
    written = make_certs(MakeCertsConfig(out=tmp_path, host=["127.0.0.1", "node-1.example"], client=["bob"]))
    assert [p.name for p in written] == ["ca.crt", "127.0.0.1.crt", "node-1.example.crt", "bob.crt"]
    ca = load(tmp_path / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, server in (("127.0.0.1", True), ("node-1.example", True), ("bob", False)):
        cert = load(tmp_path / f"{name}.crt")
        cert.verify_directly_issued_by(ca)
        usages = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert (ExtendedKeyUsageOID.SERVER_AUTH in usages) is server
        assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
        assert stat.S_IMODE((tmp_path / f"{name}.key").stat().st_mode) == 0o600
    assert alt_names(tmp_path / "127.0.0.1.crt", x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert alt_names(tmp_path / "node-1.example.crt", x509.DNSName) == ["node-1.example"]
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600


def test_a_second_run_reuses_the_ca(tmp_path: Path) -> None:
    make_certs(MakeCertsConfig(out=tmp_path, host=["a.example"]))
    ca = (tmp_path / "ca.crt").read_bytes()
    make_certs(MakeCertsConfig(out=tmp_path, host=["b.example"], client=[]))
    assert (tmp_path / "ca.crt").read_bytes() == ca
    load(tmp_path / "b.example.crt").verify_directly_issued_by(load(tmp_path / "ca.crt"))
    load(tmp_path / "a.example.crt").verify_directly_issued_by(load(tmp_path / "ca.crt"))


def test_hosts_from_a_list_file_and_a_rank_table(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# the nodes\nnode-a\n\nnode-b  # second\nnode-a\n")
    ranks = tmp_path / "ranks.json"
    records = [{"rank": r, "host": h, "node": h, "device": "cpu", "transfer_address": f"{h}:{7000 + r}"}
               for r, h in enumerate(["10.0.0.1", "node-b"])]
    ranks.write_text(json.dumps({"ranks": records}))
    out = tmp_path / "certs"
    written = make_certs(MakeCertsConfig(out=out, hosts_file=hosts, ranks=ranks, client=[]))
    assert [p.name for p in written] == ["ca.crt", "node-a.crt", "node-b.crt", "10.0.0.1.crt"]


@pytest.mark.parametrize("bad", ["a/b", "../x", "ca", "x_y", "a..b", "a-", ""])
def test_a_name_that_is_no_host_is_refused(tmp_path: Path, bad: str) -> None:
    assert isinstance(parse(["make-certs", str(tmp_path), "--host", bad]), Refused)
    assert not any(tmp_path.iterdir())


def test_the_command_writes_and_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-certs", str(tmp_path / "c"), "--host", "127.0.0.1", "localhost"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "c" / n) for n in
                                               ("ca.crt", "127.0.0.1.crt", "localhost.crt", "client.crt")]
    assert main(["make-certs", str(tmp_path / "d"), "--client"]) == 2  # nothing to issue
    assert "nothing to issue" in capsys.readouterr().err
