"""The `pdcluster` command line: every subcommand's help, the documented flag spellings, refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdcluster.bench.serving.bench import BenchServingConfig
from pdcluster.bench.transfer import BenchTransferConfig
from pdcluster.cli import main
from pdcluster.cli.commands import COMMANDS
from pdcluster.cli.main import parse
from pdcluster.cluster.launch import LaunchConfig
from pdcluster.cluster.local import UpConfig
from pdcluster.tools.tiny_model import TinyModelConfig
from replica.config import DType, ReplicaConfig
from router.config import RouterConfig, Strategy


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*name.split(), "--help"]) == 0
    out = capsys.readouterr().out
    assert f"pdcluster {name}" in out and COMMANDS[name].help.split()[0] in out


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name.split()[0] in out for name in COMMANDS)


def test_replica_flags() -> None:
    config = parse(["replica", "--model", "/m", "--port", "0", "--num-blocks", "16", "--engine-cpus", "1",
                    "2", "--no-grpc-frontend", "--role", "decode", "--dtype", "bfloat16", "--cluster",
                    "ranks.json"])
    assert isinstance(config, ReplicaConfig)
    assert (config.model, config.port, config.num_blocks, config.engine_cpus) == (Path("/m"), 0, 16, [1, 2])
    assert not config.grpc_frontend and config.role == "decode" and config.dtype is DType.BFLOAT16
    assert config.cluster == Path("ranks.json") and config.max_input_tokens is None


def test_router_lists_and_enum_values() -> None:
    config = parse(["router", "--model", "/m", "--replica", "a:1", "b:2", "--role", "prefill", "decode",
                    "--strategy", "progressive", "--http-port", "0"])
    assert isinstance(config, RouterConfig)
    assert config.replica == ["a:1", "b:2"] and config.role == ["prefill", "decode"]
    assert config.strategy == Strategy.PROGRESSIVE.value and config.http_port == 0


def test_up_and_launch_booleans() -> None:
    up = parse(["up", "--model", "/m", "--prefill", "2", "--strategy", "recompute", "--pin-decode"])
    assert isinstance(up, UpConfig) and up.pin_decode and up.prefill == 2
    assert up.strategy == Strategy.RECOMPUTE.value
    launch = parse(["launch", "cluster.toml", "--via", "slurm", "--fabric", "rdma", "--dry-run"])
    assert isinstance(launch, LaunchConfig) and launch.dry_run and launch.via == "slurm"
    assert launch.file == Path("cluster.toml") and launch.fabric == "rdma"
    assert parse(["launch", "c.toml"]) == LaunchConfig(Path("c.toml"))


def test_positional_and_choices() -> None:
    config = parse(["make-tiny-model", "/tmp/tiny", "--arch", "qwen2", "--tie-embeddings"])
    assert isinstance(config, TinyModelConfig)
    assert config.out == Path("/tmp/tiny") and config.arch == "qwen2" and config.tie_embeddings


def test_bench_group_and_explicit_flag_name() -> None:
    transfer = parse(["bench", "transfer", "--algo", "chain", "--ranks", "4", "--json", "out.json"])
    assert isinstance(transfer, BenchTransferConfig)
    assert transfer.algo == "chain" and transfer.ranks == 4 and transfer.json_out == Path("out.json")
    serving = parse(["bench", "serving", "--model", "/m", "--slo", "ttft:500", "tpot:50", "--no-pin-decode"])
    assert isinstance(serving, BenchServingConfig)
    assert serving.slo == ["ttft:500", "tpot:50"] and not serving.pin_decode and math.isinf(serving.rate)


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--modle", "/m"],  # unknown flag
        ["make-tiny-model", "/tmp/x", "--arch", "gpt9"],  # not a choice
        ["router", "--model", "/m", "--strategy", "FULL"],  # enum flags take values, not names
        ["replica", "--model", "/m"],  # --port is required
        ["bench"],  # a group needs its tool
    ],
)
def test_refused_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    capsys.readouterr()


def test_config_check_refuses_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--model", "/m", "--prefill", "0", "--decode", "0"]) == 2
    assert capsys.readouterr().err.startswith("pdcluster: invalid arguments: need at least one prefill")
