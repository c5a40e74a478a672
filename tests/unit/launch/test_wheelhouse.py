"""`pdcluster wheelhouse`: the requirements it gathers (torch, triton and nvidia-* left out; extras by
marker), the pip command lines for the target Python and platform, and the manifest (pip mocked)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from pdcluster.cli.main import parse
from pdcluster.cluster.wheelhouse import (
    MANIFEST,
    WheelhouseConfig,
    gather,
    install_line,
    left_out,
    platforms,
    read_manifest,
    requirements,
)

REQUIRES = [
    "grpcio==1.85.1",
    "torch>=2.4",
    "numpy>=1.26",
    'cupy-cuda12x>=13; extra == "gpu-cu12"',
    'nvidia-nccl-cu12>=2.20; extra == "gpu-cu12"',
    'cupy-cuda13x>=13.6; extra == "gpu-cu13"',
    'nvidia-nccl-cu13>=2.27; extra == "gpu-cu13"',
    'pytest>=8; extra == "gpu-test"',
    'triton>=3.2; extra == "dev"',
]


def test_requirements_leave_out_torch_triton_and_nvidia_and_take_only_chosen_extras() -> None:
    assert requirements(REQUIRES, []) == (["grpcio==1.85.1", "numpy>=1.26"], ["torch>=2.4"])
    gather_, skipped = requirements(REQUIRES, ["gpu-cu13", "gpu-test", "dev"])
    assert gather_ == ["grpcio==1.85.1", "numpy>=1.26", "cupy-cuda13x>=13.6", "pytest>=8"]
    assert skipped == ["torch>=2.4", "nvidia-nccl-cu13>=2.27", "triton>=3.2"]
    assert requirements(REQUIRES, [], more_left_out=["NumPy"])[0] == ["grpcio==1.85.1"]
    assert left_out("Nvidia_NCCL.cu13") and left_out("torch") and not left_out("torchvision-free")
    with pytest.raises(ValueError, match=r"only `extra == \.\.\.` markers"):
        requirements(['x>=1; extra == "a" and python_version < "3.12"'], ["a"])


def test_platform_tags_list_every_older_manylinux() -> None:
    tags = platforms("2.28", "x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-1] == "manylinux1_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert platforms("2.12", "aarch64")[-2:] == ["manylinux2010_aarch64", "manylinux1_aarch64"]


def fake_pip(out: Path, downloaded: Sequence[str]) -> tuple[list[list[str]], object]:
    """A pip that builds a wheel with METADATA and 'downloads' empty wheels of the given names."""
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> None:
        calls.append(list(argv))
        if argv[3] == "wheel":
            with zipfile.ZipFile(out / "pdcluster-0.1.0-py3-none-any.whl", "w") as wheel:
                meta = "Metadata-Version: 2.4\nName: pdcluster\nVersion: 0.1.0\n" + "".join(
                    f"Requires-Dist: {r}\n" for r in REQUIRES)
                wheel.writestr("pdcluster-0.1.0.dist-info/METADATA", meta)
        else:
            for name in downloaded:
                (out / name).write_bytes(b"wheel")

    return calls, run


def test_gather_builds_downloads_for_the_target_and_writes_the_manifest(tmp_path: Path) -> None:
    out = tmp_path / "wh"
    config = WheelhouseConfig(out=out, python="3.12", extra=["gpu-cu13"], source=Path("/src/pd"))
    calls, run = fake_pip(out, ["grpcio-1.85.1-cp312-cp312-manylinux2014_x86_64.whl"])
    record = gather(config, run, python="/py")  # type: ignore[arg-type]
    build, download = calls
    assert build == ["/py", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), "/src/pd"]
    assert download[:4] == ["/py", "-m", "pip", "download"] and "--only-binary=:all:" in download
    assert download[download.index("--python-version") + 1] == "3.12"
    assert download[download.index("--implementation") + 1] == "cp"
    assert download[download.index("--dest") + 1] == str(out)
    assert download.count("--platform") == len(platforms("2.28", "x86_64"))
    assert (out / "requirements.txt").read_text() == "grpcio==1.85.1\nnumpy>=1.26\ncupy-cuda13x>=13.6\n"
    saved = json.loads((out / MANIFEST).read_text())
    assert saved["project"] == "pdcluster-0.1.0-py3-none-any.whl" and saved["python"] == "3.12"
    assert saved["left_out"] == ["torch>=2.4", "nvidia-nccl-cu13>=2.27"] and saved["extras"] == ["gpu-cu13"]
    assert saved["install"] == "pip install --no-index --find-links . 'pdcluster[gpu-cu13]'"
    assert [w["file"] for w in saved["wheels"]] == ["grpcio-1.85.1-cp312-cp312-manylinux2014_x86_64.whl",
                                                    "pdcluster-0.1.0-py3-none-any.whl"]
    assert saved["total_bytes"] == record.total_bytes > 0 and len(saved["wheels"][0]["sha256"]) == 64
    assert read_manifest(out) == record


def test_a_dependency_that_pulls_torch_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "wh"
    _, run = fake_pip(out, ["torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl"])
    with pytest.raises(RuntimeError, match=r"pulled in what the wheelhouse leaves out: torch-2\.13\.0"):
        gather(WheelhouseConfig(out=out), run)  # type: ignore[arg-type]


def test_flags_and_refusals(tmp_path: Path) -> None:
    config = parse(["wheelhouse", "--python", "3.11", "--out", str(tmp_path), "--extra", "gpu-cu12",
                    "gpu-test", "--leave-out", "numpy"])
    assert isinstance(config, WheelhouseConfig)
    assert (config.python, config.extra, config.leave_out) == ("3.11", ["gpu-cu12", "gpu-test"], ["numpy"])
    with pytest.raises(ValueError, match=r"--python takes MAJOR\.MINOR"):
        WheelhouseConfig(python="312")
    with pytest.raises(ValueError, match=r"--glibc takes 2\.MINOR"):
        WheelhouseConfig(glibc="2.4")
    with pytest.raises(ValueError, match="is not a wheelhouse"):
        read_manifest(tmp_path)
    assert install_line("/w", []) == "pip install --no-index --find-links /w pdcluster"
