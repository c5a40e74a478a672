"""N "hosts" on this machine that behave like separate machines: each its own network and UTS
namespace (own interfaces, ports and hostname) on one switch, links shaped by tc, each running a real
OpenSSH server and, on request, a real slurmd under one slurmctld.

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
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300",
             *PACKAGES],
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

    def _daemon(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
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
        proc = self._daemon(
            self.exec_argv(host.netns, host.name, ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]),
            self.folder / f"sshd_{host.name}.log",
        )
        self._wait_listening(host, 22, proc)

    def _wait_listening(
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

    # --- Slurm --------------------------------------------------------------------------------
    def start_slurm(self) -> Path:
        """munged (a private socket), slurmctld in the head, one slurmd per host; returns SLURM_CONF."""
        munge = self.folder / "munge"
        munge.mkdir(exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        socket_path = munge / "munge.sock"
        self._daemon(
            [
                "munged",
                "-F",
                "-f",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--log-file={munge / 'munged.log'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            munge / "out.log",
        )
        end = time.monotonic() + 20
        while not socket_path.exists():
            if time.monotonic() > end:
                raise RuntimeError(f"munged did not start: {(munge / 'out.log').read_text()[-500:]}")
            time.sleep(0.05)
        conf = self._slurm_conf(socket_path)
        env_conf = ["env", f"SLURM_CONF={conf}"]
        ctld = self._daemon(
            self.exec_argv(self.head, "head", [*env_conf, "slurmctld", "-D", "-f", str(conf)]),
            self.folder / "slurm" / "slurmctld.out",
        )
        self._wait_listening(Host("head", self.head, self.head_address), 6817, ctld)
        # slurmd wants a cgroup v1 tree; `ip netns exec` remounted /sys without one. A private tmpfs with
        # the named systemd hierarchy satisfies it (proctrack/linuxproc and task/none use no cgroup).
        cgroups = (
            "mount -t tmpfs cgroup_root /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/systemd && "
            'mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd && exec "$@"'
        )
        for host in self.hosts:
            argv = ["sh", "-c", cgroups, "sh", *env_conf, "slurmd", "-D", "-N", host.name, "-f", str(conf)]
            self._daemon(
                self.exec_argv(host.netns, host.name, argv), self.folder / "slurm" / f"slurmd-{host.name}.out"
            )
        self.slurm_conf = conf
        self._wait_idle()
        return conf

    def _slurm_conf(self, munge_socket: Path) -> Path:
        folder = self.folder / "slurm"
        (folder / "state").mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(
            f"NodeName={h.name} NodeAddr={h.address} CPUs=4 RealMemory=1000 State=UNKNOWN" for h in self.hosts
        )
        names = ",".join(h.name for h in self.hosts)
        conf = folder / "slurm.conf"
        conf.write_text(f"""ClusterName={self.prefix}
SlurmctldHost=head({self.head_address})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={folder / "state"}
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder / "slurmctld.pid"}
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder / "slurmctld.log"}
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
KillWait=5
InactiveLimit=0
MinJobAge=30
{nodes}
PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        return conf

    def slurm_env(self) -> dict[str, str]:
        """The environment of a Slurm client command of this cluster."""
        assert self.slurm_conf is not None, "start_slurm() first"
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf)}

    def _wait_idle(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while True:
            done = subprocess.run(
                ["ip", "netns", "exec", self.head, "sinfo", "-h", "-o", "%t %D"],
                capture_output=True,
                text=True,
                env=self.slurm_env(),
                timeout=30,
                check=False,
            )
            if done.stdout.split() == ["idle", str(self.count)]:
                return
            if time.monotonic() > end:
                raise RuntimeError(f"Slurm nodes not idle: {done.stdout.strip()} {done.stderr.strip()}")
            time.sleep(0.3)

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
def emulated_hosts(count: int, slurm: bool = False, rate: str = "1gbit") -> Iterator[EmulatedHosts]:
    """`count` hosts with sshd (and Slurm), torn down on leaving the block."""
    with EmulatedHosts(count, rate) as hosts:
        if slurm:
            hosts.start_slurm()
        yield hosts
