"""N "hosts" on this machine that behave like separate machines: each its own network and UTS
namespace (own interfaces, ports and hostname) on one switch, links shaped by tc, each running a real
OpenSSH server; `emulated_slurm.start_slurm` adds a real slurmd on each under one slurmctld.

```
   head ns (10.R.0.1, "head": the launcher, the router, slurmctld)
        │ eth0
   ┌────┴──────────── switch ns: bridge br0 ───────────────┐
   │ h1 (tbf)              h2 (tbf)              h3 (tbf)   │  tbf RATE on both ends of each host link
   └────┬──────────────────┬─────────────────────┬─────────┘
   h1 ns 10.R.0.2       h2 ns 10.R.0.3        h3 ns 10.R.0.4   sshd -D (+ slurmd -N hN), hostname hN
```
Every address lives only inside namespaces made here, so parallel runs never collide; names carry a
run prefix (`pdh` + 4 hex digits) and an owner file, and a new run first sweeps the namespaces of
runs whose owner died. `destroy()` kills every process in the namespaces and deletes them, also
after a failure (context manager). Root, iproute2, tc and the daemons are needed: `require()`
installs the Debian packages with apt-get or says why it cannot (the tests then skip with it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PACKAGES = ("openssh-server", "openssh-client", "slurmctld", "slurmd", "slurm-client", "munge", "iproute2")
BINARIES = (
    "/usr/sbin/sshd",
    "/usr/sbin/slurmctld",
    "/usr/sbin/slurmd",
    "/usr/sbin/munged",
    "ssh",
    "ip",
    "tc",
    "unshare",
    "salloc",
    "srun",
)
OWNERS = Path("/tmp/pdcluster-emulated-hosts")  # one folder per run: its owner pid and scratch files
_PREFIX = re.compile(r"^(pdh[0-9a-f]{4})-")
_CLONE_NEWNET = 0x40000000


def _run(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
    return done


def require(slurm: bool = False) -> str:
    """Why emulated hosts cannot be made here ("" when they can); installs missing Debian packages."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, tc, sshd)"
    needed = [b for b in BINARIES if shutil.which(b) is None]
    if not slurm:
        needed = [b for b in needed if "slurm" not in b and "munge" not in b and b not in ("salloc", "srun")]
    if needed:
        if shutil.which("apt-get") is None:
            return f"missing {', '.join(needed)} and no apt-get to install {' '.join(PACKAGES)}"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (
            ["apt-get", "update", "-q"],
            [
                "apt-get",
                "install",
                "-y",
                "-q",
                "--no-install-recommends",
                "-o",
                "DPkg::Lock::Timeout=300",
                *PACKAGES,
            ],
        ):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, check=False)
            if done.returncode != 0:
                return f"`{' '.join(argv)}` failed: {done.stderr.strip()[-300:]}"
        still = [b for b in needed if shutil.which(b) is None]
        if still:
            return f"still missing after apt-get install: {', '.join(still)}"
    probe = f"pdhprobe{os.getpid()}"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return ""


@dataclass(frozen=True)
class Host:
    """One emulated host."""

    name: str  # its hostname ("h1")
    netns: str
    address: str


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_pids(netns: str) -> list[int]:
    """Processes whose network namespace is `netns`."""
    done = _run("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _kill_netns(netns: str) -> None:
    for _ in range(50):
        pids = netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    _run("ip", "netns", "del", netns, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose owner process is gone; returns their prefixes."""
    listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
    prefixes: dict[str, list[str]] = {}
    for line in listed:
        name = line.split(" ")[0]
        match = _PREFIX.match(name)
        if match:
            prefixes.setdefault(match.group(1), []).append(name)
    swept = []
    for prefix, names in prefixes.items():
        owner = OWNERS / prefix / "owner"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and _alive(pid):
            continue
        for name in names:
            _kill_netns(name)
        _stop_munge(OWNERS / prefix)
        shutil.rmtree(OWNERS / prefix, ignore_errors=True)
        swept.append(prefix)
    return swept


def _stop_munge(folder: Path) -> None:
    with contextlib.suppress(OSError, ValueError, ProcessLookupError):
        os.kill(int((folder / "munge" / "munged.pid").read_text()), signal.SIGTERM)


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    """`fn()` run on a thread that joined network namespace `netns` (sockets it opens live there)."""
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns({netns}) failed")
        finally:
            os.close(fd)
        try:
            result.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


@dataclass
class EmulatedHosts:
    """The head, N hosts and their switch; sshd on each host; Slurm on request."""

    count: int
    rate: str = "1gbit"
    latency: str = "5ms"
    prefix: str = field(default_factory=lambda: f"pdh{secrets.token_hex(2)}")
    subnet: str = field(default_factory=lambda: f"10.{100 + secrets.randbelow(100)}.{secrets.randbelow(250)}")
    hosts: list[Host] = field(default_factory=list)
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)
    slurm_conf: Path | None = None

    @property
    def folder(self) -> Path:
        """Scratch files of this run (keys, configs, daemon logs)."""
        return OWNERS / self.prefix

    @property
    def head(self) -> str:
        """The namespace of the head node (launcher, router, slurmctld)."""
        return f"{self.prefix}-head"

    @property
    def head_address(self) -> str:
        """The head node's address."""
        return f"{self.subnet}.1"

    @property
    def ssh_config(self) -> Path:
        """An ssh client config that reaches every host as root with this run's key."""
        return self.folder / "ssh_config"

    def __enter__(self) -> EmulatedHosts:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # --- network ------------------------------------------------------------------------------
    def create(self) -> None:
        """Namespaces, links, shaping, keys and one sshd per host."""
        sweep_stale()
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "owner").write_text(str(os.getpid()))
        switch = f"{self.prefix}-sw"
        _run("ip", "netns", "add", switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        self._attach(switch, self.head, "head", self.head_address, shaped=False)
        for i in range(1, self.count + 1):
            host = Host(f"h{i}", f"{self.prefix}-h{i}", f"{self.subnet}.{i + 1}")
            self._attach(switch, host.netns, host.name, host.address, shaped=True)
            self.hosts.append(host)
        self._keys()
        for host in self.hosts:
            self.start_sshd(host)

    def _attach(self, switch: str, netns: str, port: str, address: str, shaped: bool) -> None:
        _run("ip", "netns", "add", netns)
        _run("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _run("ip", "-n", netns, "link", "set", "eth0", "up")
        _run("ip", "-n", netns, "link", "set", "lo", "up")
        if shaped:  # both directions: out of the host (eth0) and into it (its switch port)
            for ns, dev in ((netns, "eth0"), (switch, port)):
                _run(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    self.rate,
                    "burst",
                    "128kb",
                    "latency",
                    self.latency,
                )

    def exec_argv(self, netns: str, hostname: str, argv: list[str]) -> list[str]:
        """`argv` inside `netns` with its own UTS namespace named `hostname`."""
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", netns, "unshare", "--uts", "sh", "-c", script, hostname, *argv]

    def daemon(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        """Start a daemon of this run (killed by `destroy`), its output into `log`."""
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.daemons.append(proc)
        return proc

    # --- ssh ----------------------------------------------------------------------------------
    def _keys(self) -> None:
        for name in ("host_key", "user_key", "stranger_key"):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / name))
        (self.folder / "authorized_keys").write_text((self.folder / "user_key.pub").read_text())
        (self.folder / "stranger_keys").write_text((self.folder / "stranger_key.pub").read_text())
        self.ssh_config.write_text(
            "Host *\n  User root\n"
            f"  IdentityFile {self.folder / 'user_key'}\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
        )
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation folder

    def start_sshd(self, host: Host, refuse_key: bool = False) -> None:
        """A real sshd on `host`; with `refuse_key` it knows only a key this run never uses."""
        keys = self.folder / ("stranger_keys" if refuse_key else "authorized_keys")
        config = self.folder / f"sshd_{host.name}"
        config.write_text(
            f"ListenAddress {host.address}\nPort 22\nHostKey {self.folder / 'host_key'}\n"
            f"AuthorizedKeysFile {keys}\nPermitRootLogin yes\nUsePAM no\nStrictModes no\n"
            f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nPrintMotd no\nPrintLastLog no\n"
            f"PidFile {self.folder / f'sshd_{host.name}.pid'}\n"
        )
        proc = self.daemon(
            self.exec_argv(host.netns, host.name, ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]),
            self.folder / f"sshd_{host.name}.log",
        )
        self.wait_listening(host, 22, proc)

    def wait_listening(
        self, host: Host, port: int, proc: subprocess.Popen[bytes], timeout: float = 20
    ) -> None:
        import socket

        def ready() -> bool:
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex((host.address, port)) == 0

        end = time.monotonic() + timeout
        while not in_netns(self.head, ready):
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"daemon on {host.name}:{port} did not start: see {self.folder}")
            time.sleep(0.1)

    def restart_sshd(self, host: Host, refuse_key: bool) -> None:
        """Stop `host`'s sshd (daemon only) and start it again accepting or refusing this run's key."""
        pid_file = self.folder / f"sshd_{host.name}.pid"
        with contextlib.suppress(OSError, ValueError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        end = time.monotonic() + 10
        while pid_file.exists() and time.monotonic() < end:
            time.sleep(0.05)
        self.start_sshd(host, refuse_key)

    # --- inspection and teardown --------------------------------------------------------------
    def processes(self, host: Host) -> list[str]:
        """Command lines of the processes on `host` other than its daemons (sshd, slurmd)."""
        daemons = {p.pid for p in self.daemons}
        found = []
        for pid in netns_pids(host.netns):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
            except OSError:
                continue
            if pid in daemons:
                continue
            found.append(f"{pid} {cmdline}")
        return found

    def destroy(self) -> None:
        """Kill every process of every namespace of this run, delete the namespaces, remove the files."""
        for proc in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for netns in [self.head, *(h.netns for h in self.hosts), f"{self.prefix}-sw"]:
            _kill_netns(netns)
        for proc in self.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        _stop_munge(self.folder)
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def emulated_hosts(count: int, rate: str = "1gbit") -> Iterator[EmulatedHosts]:
    """`count` hosts with sshd, torn down on leaving the block (also after a failure)."""
    with EmulatedHosts(count, rate) as hosts:
        yield hosts
