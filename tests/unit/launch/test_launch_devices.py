"""`pdcluster launch` and devices: `--device cuda` / `--gpu-memory-fraction` reach every CUDA replica
(its `CUDA_VISIBLE_DEVICES=N` from the rank table's `cuda:N`), CPU workers get `--device cpu`,
`[launch] device` / `--device` put every node on the CPU or require CUDA, and `--wheelhouse` copies
a wheelhouse to every node and installs it there (the script runs here against a fake pip)."""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import tarfile
from pathlib import Path, PurePosixPath

import pytest

from pdcluster.cluster.clusterfile import ClusterFileError, LaunchDevice, parse, with_launch
from pdcluster.cluster.launch import Launch, LaunchConfig, load, pack_tar
from pdcluster.cluster.launch_plan import Commands, node_python, place
from pdcluster.cluster.remote import fan_out
from tests.unit.launch.test_launch_plan import MIXED, inventories


def commands(cluster: object) -> Commands:
    return Commands(cluster, "RUN1", ("/venv/bin/pdcluster",), PurePosixPath("/srv/pd"))  # type: ignore[arg-type]


def replica_argv(c: Commands, placement: object) -> list[str]:
    return shlex.split(c.replica_script(placement).splitlines()[3])  # type: ignore[arg-type]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_cuda_replicas_get_device_and_fraction_cpu_workers_device_cpu(tmp_path: Path) -> None:
    text = MIXED.replace('fabric = "tcp"', 'fabric = "tcp"\ngpu_memory_fraction = 0.8').replace(
        'devices = [0]', 'devices = [0]\ngpu_memory_fraction = 0.5')
    cluster = parse(tmp_path / "c.toml", text)
    placed = place(cluster, inventories(tmp_path, cluster))
    c = commands(cluster)
    dgx, ws, cpu = replica_argv(c, placed[3]), replica_argv(c, placed[8]), replica_argv(c, placed[9])
    assert "CUDA_VISIBLE_DEVICES=3" in c.replica_script(placed[3]) and placed[3].device == "cuda:3"
    assert (flag(dgx, "--device"), flag(dgx, "--gpu-memory-fraction")) == ("cuda", "0.8")
    assert (flag(ws, "--device"), flag(ws, "--gpu-memory-fraction")) == ("cuda", "0.5")  # the node's own
    assert (flag(cpu, "--device"), flag(cpu, "--gpu-memory-fraction")) == ("cpu", None)


def test_launch_device_cpu_makes_every_node_cpu_workers(tmp_path: Path) -> None:
    text = MIXED.replace('devices = [0]\n', '').replace('fabric = "tcp"', 'fabric = "tcp"\ndevice = "cpu"')
    cluster = parse(tmp_path / "c.toml", text)
    assert cluster.launch.device is LaunchDevice.CPU
    placed = place(cluster, inventories(tmp_path, cluster))
    assert {p.device for p in placed} == {"cpu"} and not any(p.cuda_visible_devices for p in placed)
    with pytest.raises(ClusterFileError,
                       match=r'c.toml:21: ws lists CUDA devices but the launch\'s device is "cpu"'):
        parse(tmp_path / "c.toml", MIXED.replace('fabric = "tcp"', 'fabric = "tcp"\ndevice = "cpu"'))


def test_launch_device_cuda_needs_a_gpu_on_every_node(tmp_path: Path) -> None:
    text = MIXED.replace('devices = "cpu"', 'devices = "auto"')
    cluster = with_launch(parse(tmp_path / "c.toml", text), device=LaunchDevice.CUDA)
    with pytest.raises(ClusterFileError, match="the launch's device is cuda, but discovery found no CUDA "
                                               "device on cpu"):
        place(cluster, inventories(tmp_path, cluster))
    with pytest.raises(ClusterFileError, match='cpu has devices = "cpu" but the launch\'s device is "cuda"'):
        with_launch(parse(tmp_path / "c.toml", MIXED), device=LaunchDevice.CUDA)


@pytest.mark.parametrize(("change", "message"), [
    (('fabric = "tcp"', 'fabric = "tcp"\ngpu_memory_fraction = 1.5'),
     r"c.toml:7: launch.gpu_memory_fraction must be in \(0, 1\], not 1.5"),
    (('fabric = "tcp"', 'fabric = "tcp"\ndevice = "tpu"'),
     "c.toml:7: launch.device must be one of auto, cpu, cuda"),
    (("ssh_port = 2222", "ssh_port = 2222\ngpu_memory_fraction = 0"), r"gpu_memory_fraction must be in"),
])
def test_bad_values_name_their_line(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    with pytest.raises(ClusterFileError, match=message):
        parse(tmp_path / "c.toml", MIXED.replace(*change))


def test_command_line_overrides_the_file(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text(MIXED.replace('devices = [0]\n', ''))
    house = wheelhouse(tmp_path / "wh")
    cluster, _ = load(LaunchConfig(file, device="cpu", gpu_memory_fraction=0.6, wheelhouse=house))
    assert (cluster.launch.device, cluster.launch.gpu_memory_fraction, cluster.launch.wheelhouse) == (
        LaunchDevice.CPU, 0.6, house.resolve())
    with pytest.raises(ValueError, match="is not a wheelhouse"):
        load(LaunchConfig(file, wheelhouse=tmp_path))
    with pytest.raises(ValueError, match="--gpu-memory-fraction must be in"):
        LaunchConfig(file, gpu_memory_fraction=2.0)


def test_node_python_is_the_pdcluster_commands_interpreter() -> None:
    assert node_python(["/opt/pd/.venv/bin/pdcluster"]) == ["/opt/pd/.venv/bin/python"]
    assert node_python(["/usr/bin/python3.12", "-m", "pdcluster"]) == ["/usr/bin/python3.12"]
    assert node_python(["pdcluster"]) == ["python3"]


def wheelhouse(folder: Path, extras: tuple[str, ...] = ("gpu-cu13",)) -> Path:
    """A made-up wheelhouse: two "wheels" and the manifest `pdcluster wheelhouse` would write."""
    folder.mkdir(parents=True)
    for name in ("pdcluster-0.1.0-py3-none-any.whl", "tyro-1.0.0-py3-none-any.whl"):
        (folder / name).write_bytes(b"PK" + name.encode())
    (folder / "requirements.txt").write_text("tyro>=1.0\n")
    (folder / "manifest.json").write_text(json.dumps({
        "project": "pdcluster-0.1.0-py3-none-any.whl", "python": "3.12", "platforms": [],
        "extras": list(extras),
        "left_out": ["torch>=2.4"], "commands": [], "created": "", "wheels": [
            {"file": "pdcluster-0.1.0-py3-none-any.whl", "bytes": 3, "sha256": ""}]}))
    return folder


def test_the_wheelhouse_script_unpacks_and_installs_without_an_index(tmp_path: Path) -> None:
    house = wheelhouse(tmp_path / "wh")
    packed = pack_tar(house, tmp_path / "wh.tar")
    with tarfile.open(packed) as tar:
        names = sorted(tar.getnames())
    assert names == [
        "manifest.json", "pdcluster-0.1.0-py3-none-any.whl", "tyro-1.0.0-py3-none-any.whl"]
    # a fake interpreter beside the fake pdcluster command: it records each pip call
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    calls = tmp_path / "calls"
    (venv / "python").write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    (venv / "python").chmod(0o755)
    cluster = parse(tmp_path / "c.toml", MIXED)
    c = Commands(cluster, f"unit-wh-{tmp_path.name}", (str(venv / "pdcluster"),), PurePosixPath("/"))
    script = c.wheelhouse_script(cluster.nodes[0], "pdcluster-0.1.0-py3-none-any.whl", ["gpu-cu13"])
    try:
        with packed.open("rb") as stdin:
            done = subprocess.run(["bash", "-c", script], stdin=stdin, capture_output=True, timeout=30,
                                  check=False)
        assert done.returncode == 0, done.stderr
        staged = Path(str(c.node_dir)) / "wheelhouse"
        assert (staged / "tyro-1.0.0-py3-none-any.whl").read_bytes() == b"PKtyro-1.0.0-py3-none-any.whl"
        first, second = calls.read_text().splitlines()
        assert first == f"-m pip install --no-index --find-links {staged} --disable-pip-version-check -q " \
                        "pdcluster[gpu-cu13]"
        assert second.endswith(f"--no-deps --force-reinstall {staged}/pdcluster-0.1.0-py3-none-any.whl")
    finally:
        subprocess.run(["rm", "-rf", str(c.node_dir)], check=False)


def test_fan_out_streams_a_file_on_stdin(tmp_path: Path) -> None:
    cluster = parse(tmp_path / "c.toml", MIXED)
    data = tmp_path / "data"
    data.write_bytes(bytes(range(256)) * 4096)  # 1 MiB, not text
    answers = fan_out(list(cluster.nodes), lambda _: ["sh", "-c", "wc -c"], 30, 2, stdin_of=lambda _: data)
    assert [a.out.strip() for a in answers] == [str(256 * 4096)] * 3
    text = fan_out(list(cluster.nodes)[:1], lambda _: ["cat"], 30, 1, stdin_of=lambda _: "hello")
    assert text[0].out == "hello"


def test_dry_run_shows_the_wheelhouse_install_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "c.toml"
    file.write_text(MIXED)
    cluster, via = load(LaunchConfig(file, wheelhouse=wheelhouse(tmp_path / "wh")))
    launch = Launch(cluster, via, run_id="RUN1")
    monkeypatch.setattr(launch, "discover", lambda deadline: inventories(tmp_path, cluster))
    text = launch.dry_run()
    assert text.startswith("# wheelhouse on dgx (its tar on stdin)\n")
    assert "--no-index --find-links /tmp/pdcluster-RUN1/wheelhouse" in text
    assert "pdcluster[gpu-cu13]" in text and "# placement" in text
    assert "--device cuda --gpu-memory-fraction 0.9" in text


def test_install_sends_the_tar_to_every_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "c.toml"
    file.write_text(MIXED.replace('[launch]\n', f'[launch]\nlog_dir = "{tmp_path / "logs"}"\n'))
    cluster, via = load(LaunchConfig(file, via="local", wheelhouse=wheelhouse(tmp_path / "wh")))
    launch = Launch(cluster, via, run_id="RUN1")
    seen: list[tuple[str, bytes]] = []

    def fake_fan_out(nodes: list[object], script_of: object, timeout: float, stdin_of: object = None
                     ) -> list[object]:
        from pdcluster.cluster.remote import Answer

        for node in nodes:
            body = stdin_of(node) if callable(stdin_of) else None
            seen.append((script_of(node), Path(body).read_bytes() if isinstance(body, Path) else b""))  # type: ignore[operator]
        return [Answer(n, 0, "", "", 0.1) for n in nodes]  # type: ignore[arg-type]

    monkeypatch.setattr(launch, "_fan_out", fake_fan_out)
    launch.install(1e12)
    assert len(seen) == 3 and all("pip install --no-index" in script for script, _ in seen)
    with tarfile.open(fileobj=io.BytesIO(seen[0][1])) as tar:
        names = tar.getnames()
    assert "manifest.json" in names and not (launch.run_dir / "wheelhouse.tar").exists()
