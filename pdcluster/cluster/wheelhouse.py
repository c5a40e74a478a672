"""`pdcluster wheelhouse`: every wheel a node needs to install pdcluster without a package registry,
except torch (and what torch brings: triton, the nvidia-* CUDA libraries), for a target Python.

```
 pip wheel --no-deps -w OUT SOURCE                          ─► OUT/pdcluster-0.1.0-py3-none-any.whl
 its Requires-Dist (+ --extra), torch/triton/nvidia-* left out ─► OUT/requirements.txt
 pip download --only-binary=:all: --python-version 3.12 --implementation cp
              --platform manylinux_2_28_x86_64 … (down to manylinux1) -r OUT/requirements.txt -d OUT
                                                            ─► OUT/*.whl (the tree, resolved for the target)
 OUT/manifest.json: target, extras, what was left out, every wheel with its size and sha256, the install line
```
On the node (torch of the right CUDA build already there):
`pip install --no-index --find-links OUT 'pdcluster[EXTRAS]'`. `pdcluster launch --wheelhouse OUT`
copies the folder to every node and runs that before anything else (`launch_plan.Commands`).
Everything but running pip is pure and unit-tested with pip mocked.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from email.parser import Parser
from pathlib import Path

from pdcluster import SOURCE_ROOT

MANIFEST = "manifest.json"
REQUIREMENTS = "requirements.txt"
PROJECT = "pdcluster"
LEFT_OUT = ("torch", "triton")
"""Never gathered: the node has them, built for its CUDA version (with the `nvidia-*` libraries)."""
LEFT_OUT_PREFIXES = ("nvidia-",)
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")

Runner = Callable[[Sequence[str]], None]
"""Runs one command (pip), raising when it fails: `subprocess.run(..., check=True)` here, a fake in tests."""


@dataclass
class WheelhouseConfig:
    """Flags of `pdcluster wheelhouse`."""

    out: Path = field(default=Path("wheelhouse"), metadata={"help": "folder to write the wheels into"})
    python: str = field(default="3.12", metadata={"help": "the nodes' Python version, MAJOR.MINOR"})
    extra: list[str] = field(default_factory=list, metadata={"help": (
        "extras of pdcluster to gather too (gpu-cu12, gpu-cu13, gpu-test, dev, rdma)")})
    glibc: str = field(default="2.28", metadata={"help": (
        "the oldest glibc of the nodes: wheels up to manylinux_2_<minor> are taken")})
    arch: str = field(default="x86_64", metadata={"help": "the nodes' CPU architecture"})
    leave_out: list[str] = field(default_factory=list, metadata={"help": (
        "more distributions the nodes already have (besides torch, triton and nvidia-*)")})
    source: Path = field(default=SOURCE_ROOT, metadata={"help": "the project to build (its pyproject.toml)"})

    def __post_init__(self) -> None:
        self.out, self.source = Path(self.out), Path(self.source)
        if not re.fullmatch(r"3\.\d+", self.python):
            raise ValueError(f"--python takes MAJOR.MINOR like 3.12, got {self.python!r}")
        if not re.fullmatch(r"2\.\d+", self.glibc) or int(self.glibc.split(".")[1]) < 5:
            raise ValueError(f"--glibc takes 2.MINOR (>= 2.5) like 2.28, got {self.glibc!r}")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them ("Nvidia_NCCL.cu13" -> "nvidia-nccl-cu13")."""
    return re.sub(r"[-_.]+", "-", name).lower()


def left_out(name: str, more: Sequence[str] = ()) -> bool:
    """Whether a distribution is not gathered: torch's family, or one the nodes already have."""
    name = canonical(name)
    return name in LEFT_OUT or name.startswith(LEFT_OUT_PREFIXES) or name in {canonical(m) for m in more}


def requirement_name(requirement: str) -> str:
    """The distribution a requirement names ("grpcio==1.85.1" -> "grpcio")."""
    found = _NAME.match(requirement)
    if found is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return canonical(found.group(1))


def requirements(requires_dist: Sequence[str], extras: Sequence[str], more_left_out: Sequence[str] = ()
                 ) -> tuple[list[str], list[str]]:
    """(to gather, left out) of a wheel's Requires-Dist lines for `extras`: a line whose marker names
    an extra is taken only for those extras, with the marker dropped (pip does not know the extra)."""
    wanted = {canonical(e) for e in extras}
    gather: list[str] = []
    skipped: list[str] = []
    for line in requires_dist:
        spec, _, marker = line.partition(";")
        extra = _EXTRA_MARKER.search(marker)
        if extra is not None:
            if canonical(extra.group(1)) not in wanted:
                continue
            rest = _EXTRA_MARKER.sub("", marker).strip(" ()")
            if rest and rest not in ("and", "or"):
                raise ValueError(f"requirement {line!r}: only `extra == ...` markers are understood")
            marker = ""
        spec = spec.strip() + (f"; {marker.strip()}" if marker.strip() else "")
        (skipped if left_out(requirement_name(spec), more_left_out) else gather).append(spec)
    return gather, skipped


def platforms(glibc: str, arch: str) -> list[str]:
    """pip's `--platform` tags for nodes with at least this glibc, newest first; pip does not expand
    manylinux_2_X to older tags itself, so every older one is listed, and the legacy aliases."""
    minor = int(glibc.split(".")[1])
    tags = [f"manylinux_2_{m}_{arch}" for m in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for m, name in sorted(legacy.items(), reverse=True) if m <= minor]


def wheel_command(python: str, source: Path, out: Path) -> list[str]:
    """Build pdcluster's own wheel (pure Python: one wheel serves every target)."""
    return [python, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(source)]


def download_command(python: str, config: WheelhouseConfig, requirements_file: Path) -> list[str]:
    """Download the resolved dependency tree as wheels for the target Python and platform."""
    args = [python, "-m", "pip", "download", "--only-binary=:all:", "--python-version", config.python,
            "--implementation", "cp", "--dest", str(config.out), "--requirement", str(requirements_file)]
    for tag in platforms(config.glibc, config.arch):
        args += ["--platform", tag]
    return args


def install_line(folder: str, extras: Sequence[str]) -> str:
    """What a node runs (the torch of its CUDA build already installed)."""
    target = f"{PROJECT}[{','.join(extras)}]" if extras else PROJECT
    return shlex.join(["pip", "install", "--no-index", "--find-links", folder, target])


def project_wheel(folder: Path) -> Path:
    """pdcluster's own wheel in `folder` (the newest when several are)."""
    wheels = sorted(folder.glob(f"{PROJECT}-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise RuntimeError(f"no {PROJECT} wheel in {folder}")
    return wheels[-1]


def requires_dist(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    return metadata.get_all("Requires-Dist") or []


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for chunk in iter(lambda: data.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Wheel:
    """One wheel of the folder."""

    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a wheelhouse holds and how it was made (OUT/manifest.json)."""

    project: str  # pdcluster's own wheel
    python: str
    platforms: tuple[str, ...]
    extras: tuple[str, ...]
    left_out: tuple[str, ...]  # requirements not gathered (the node has them)
    commands: tuple[str, ...]  # the pip command lines that made it
    created: str
    wheels: tuple[Wheel, ...]

    @property
    def total_bytes(self) -> int:
        """The size of every wheel together."""
        return sum(w.bytes for w in self.wheels)

    def to_json(self) -> str:
        """The manifest file's text."""
        record = {**asdict(self), "total_bytes": self.total_bytes, "install": install_line(".", self.extras)}
        return json.dumps(record, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Read a manifest file's text (ValueError when it is not one)."""
        try:
            record = json.loads(text)
            return cls(record["project"], record["python"], tuple(record["platforms"]),
                       tuple(record["extras"]), tuple(record["left_out"]), tuple(record["commands"]),
                       record["created"],
                       tuple(Wheel(**w) for w in record["wheels"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a wheelhouse manifest: {exc!r}") from None


def manifest(config: WheelhouseConfig, project: Path, skipped: Sequence[str],
             commands: Sequence[Sequence[str]]) -> Manifest:
    """What `config.out` holds now."""
    wheels = tuple(Wheel(w.name, w.stat().st_size, _sha256(w)) for w in sorted(config.out.glob("*.whl")))
    return Manifest(project.name, config.python, tuple(platforms(config.glibc, config.arch)),
                    tuple(config.extra), tuple(skipped), tuple(shlex.join(c) for c in commands),
                    time.strftime("%Y-%m-%dT%H:%M:%S%z"), wheels)


def gather(config: WheelhouseConfig, run: Runner, python: str = sys.executable) -> Manifest:
    """Build, resolve and download into `config.out`; write and return the manifest."""
    config.out.mkdir(parents=True, exist_ok=True)
    for old in config.out.glob(f"{PROJECT}-*.whl"):
        old.unlink()  # one project wheel: the one built now
    build = wheel_command(python, config.source, config.out)
    run(build)
    project = project_wheel(config.out)
    gather_, skipped = requirements(requires_dist(project), config.extra, config.leave_out)
    listed = config.out / REQUIREMENTS
    listed.write_text("".join(f"{line}\n" for line in gather_))
    download = download_command(python, config, listed)
    run(download)
    pulled = [w.name for w in config.out.glob("*.whl") if left_out(w.name.split("-")[0], config.leave_out)]
    if pulled:
        raise RuntimeError(f"a dependency pulled in what the wheelhouse leaves out: {', '.join(pulled)}")
    record = manifest(config, project, skipped, [build, download])
    (config.out / MANIFEST).write_text(record.to_json())
    return record


def read_manifest(folder: Path) -> Manifest:
    """A wheelhouse's manifest (ValueError when the folder is not one)."""
    try:
        return Manifest.from_json((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder} is not a wheelhouse (`pdcluster wheelhouse --out {folder}`): "
                         f"{MANIFEST}: {exc}") from None


def _pip(argv: Sequence[str]) -> None:
    print(f"pdcluster wheelhouse: {shlex.join(argv)}", file=sys.stderr, flush=True)
    done = subprocess.run(list(argv), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pip exited with {done.returncode}: {shlex.join(argv)}")


def run(config: WheelhouseConfig) -> int:
    """Entry point of `pdcluster wheelhouse`."""
    record = gather(config, _pip)
    print(f"pdcluster wheelhouse: {len(record.wheels)} wheels, {record.total_bytes / 1e6:.1f} MB in "
          f"{config.out} for Python {config.python}; left out {', '.join(record.left_out) or 'nothing'}\n"
          f"on a node: {install_line(str(config.out), config.extra)}", flush=True)
    return 0
