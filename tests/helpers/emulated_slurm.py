"""A real Slurm on emulated hosts: munged on a private socket, slurmctld on the head node, one slurmd
per host (each in its host's namespaces), configured in the run's scratch folder.

```
 munged --socket=RUN/munge/munge.sock          (root namespace; every daemon and client reaches it by path)
 slurmctld -D                 in the head ns   SlurmctldHost=head(10.R.0.1)
 slurmd -D -N hI              in host hI's ns  NodeName=hI NodeAddr=10.R.0.(I+1)
 clients: SLURM_CONF=RUN/slurm/slurm.conf (slurm_env), run in the head ns (salloc, srun, squeue, scancel)
```
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path

from tests.helpers.emulated_hosts import EmulatedHosts, Host


def start_slurm(hosts: EmulatedHosts) -> Path:
    """munged (a private socket), slurmctld in the head, one slurmd per host; returns SLURM_CONF."""
    munge = hosts.folder / "munge"
    munge.mkdir(exist_ok=True)
    key = munge / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    socket_path = munge / "munge.sock"
    hosts.daemon(
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
    conf = _slurm_conf(hosts, socket_path)
    env_conf = ["env", f"SLURM_CONF={conf}"]
    ctld = hosts.daemon(
        hosts.exec_argv(hosts.head, "head", [*env_conf, "slurmctld", "-D", "-f", str(conf)]),
        hosts.folder / "slurm" / "slurmctld.out",
    )
    hosts.wait_listening(Host("head", hosts.head, hosts.head_address), 6817, ctld)
    # slurmd wants a cgroup v1 tree; `ip netns exec` remounted /sys without one. A private tmpfs with
    # the named systemd hierarchy satisfies it (proctrack/linuxproc and task/none use no cgroup).
    cgroups = (
        "mount -t tmpfs cgroup_root /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/systemd && "
        'mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd && exec "$@"'
    )
    for host in hosts.hosts:
        argv = ["sh", "-c", cgroups, "sh", *env_conf, "slurmd", "-D", "-N", host.name, "-f", str(conf)]
        hosts.daemon(
            hosts.exec_argv(host.netns, host.name, argv), hosts.folder / "slurm" / f"slurmd-{host.name}.out"
        )
    hosts.slurm_conf = conf
    _wait_idle(hosts)
    return conf


def _slurm_conf(hosts: EmulatedHosts, munge_socket: Path) -> Path:
    folder = hosts.folder / "slurm"
    (folder / "state").mkdir(parents=True, exist_ok=True)
    nodes = "\n".join(
        f"NodeName={h.name} NodeAddr={h.address} CPUs=4 RealMemory=1000 State=UNKNOWN" for h in hosts.hosts
    )
    names = ",".join(h.name for h in hosts.hosts)
    conf = folder / "slurm.conf"
    conf.write_text(f"""ClusterName={hosts.prefix}
SlurmctldHost=head({hosts.head_address})
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


def slurm_env(hosts: EmulatedHosts) -> dict[str, str]:
    """The environment of a Slurm client command of this cluster."""
    assert hosts.slurm_conf is not None, "start_slurm() first"
    return {**os.environ, "SLURM_CONF": str(hosts.slurm_conf)}


def _wait_idle(hosts: EmulatedHosts, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while True:
        done = subprocess.run(
            ["ip", "netns", "exec", hosts.head, "sinfo", "-h", "-o", "%t %D"],
            capture_output=True,
            text=True,
            env=slurm_env(hosts),
            timeout=30,
            check=False,
        )
        if done.stdout.split() == ["idle", str(hosts.count)]:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"Slurm nodes not idle: {done.stdout.strip()} {done.stderr.strip()}")
        time.sleep(0.3)
