"""Failures a new user meets first end in one line naming the cause, a non-zero exit and no traceback
(`--debug` shows it): a folder without config.json, a port in use, a cluster file with a mistake."""

from __future__ import annotations

import importlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdcluster.cli import main
from pdcluster.cluster.clusterfile import ClusterFileError


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


def test_replica_on_a_folder_without_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replica", "--model", str(tmp_path), "--port", "0"]) == 2
    assert one_line(capsys) == (
        f"pdcluster replica: model folder {tmp_path} has no config.json (not a Hugging Face checkpoint)"
    )


@pytest.mark.parametrize("command", ["up", "router"])
def test_missing_folder_and_unreadable_config(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--model", str(tmp_path / "nope")]) == 2
    assert one_line(capsys).endswith(f"model folder {tmp_path / 'nope'} does not exist")
    (tmp_path / "config.json").write_text("{not json")
    assert main([command, "--model", str(tmp_path)]) == 2
    assert "config.json is not readable JSON" in one_line(capsys)


def test_unsupported_model_is_named_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    assert main(["replica", "--model", str(tmp_path), "--port", "0"]) == 2
    assert one_line(capsys).startswith(f"pdcluster replica: model folder {tmp_path}: ")


@pytest.mark.parametrize("command", ["replica", "up"])
def test_a_tp_degree_that_does_not_divide_the_model_is_named_before_any_process_starts(
    command: str, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["--port", "0", "--num-blocks", "8"] if command == "replica" else ["--prefill", "0"]
    assert main([command, "--model", str(tiny_llama), "--tp", "3", *extra]) == 2
    expected = f"pdcluster {command}: --tp 3: tensor parallel degree 3 does not divide "
    assert one_line(capsys).startswith(expected)


def test_ports_in_use(tiny_llama: Path, busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--model", str(tiny_llama), "--http-port", str(busy_port)]) == 2
    assert one_line(capsys) == f"pdcluster up: port {busy_port} on 127.0.0.1 is already in use (--http-port)"
    router = ["router", "--model", str(tiny_llama), "--http-port", "0"]
    assert main([*router, "--admin-port", str(busy_port)]) == 2
    assert one_line(capsys).endswith("already in use (--admin-port)")
    assert main(["replica", "--model", str(tiny_llama), "--port", str(busy_port)]) == 2
    assert one_line(capsys).endswith("already in use (--port)")
    assert main(["replica", "--model", str(tiny_llama), "--port", "1", "--host", "192.0.2.77"]) == 2
    assert "cannot listen on 192.0.2.77:1" in one_line(capsys)


def test_cluster_file_mistakes_and_debug(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "m"\n[[nodes]]\naddress = "a"\nprefill = 1\ncolour = "red"\n')
    for command in ("launch", "status", "down"):
        assert main([command, str(path)]) == 2
        line = one_line(capsys)
        assert line.startswith(f"pdcluster {command}: {path}:6: unknown key 'nodes[0].colour' (known: ")
    with pytest.raises(ClusterFileError):
        main(["launch", str(path), "--debug"])


def test_an_unexpected_error_names_its_type(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(config: object) -> int:
        raise KeyError("rank 7")

    # `pdcluster.cli.main` the attribute is the function; the module is only reached by its import path
    monkeypatch.setattr(importlib.import_module("pdcluster.cli.main"), "runner_of", lambda config: broken)
    assert main(["devices"]) == 1
    assert one_line(capsys) == "pdcluster devices: KeyError: 'rank 7' (run with --debug for the traceback)"
    with pytest.raises(KeyError):
        main(["--debug", "devices"])
