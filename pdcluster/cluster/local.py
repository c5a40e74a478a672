"""`pdcluster up`: a whole cluster on this machine — N prefill + M decode (+ K inactive) replica
processes and a router — with one ready line, and a clean stop of everything it started.

```
 pdcluster up ─┬─ pdcluster replica --rank 0 (prefill)   ─┐ stdout: "pdcluster replica serving on H:P"
               ├─ pdcluster replica --rank 1 (decode)    ─┤
               └─ pdcluster router --replica H:P … --role …  stdout: "pdcluster router ready: http=… admin=…"
```
Children get SIGTERM when this process dies (Linux parent-death signal), so none is orphaned even
if `pdcluster up` itself is killed; on Ctrl-C / SIGTERM the router stops first, then the replicas.
Under `pdcluster up` a replica that dies is restarted on its own ports (`supervisor.py`); when the
restart budget is spent the router is stopped too and `up` exits 1.
With `--engine simulated` the replicas behave like `--gpu` running `--model-card` (no torch, one
process each, no gRPC front process); `--model` then only lends its tokenizer, and every bandwidth
flag is the emulated cluster's full-scale figure (the replicas pace at it times `--byte-scale`).
`--device cuda` puts the torch replicas on the visible GPUs, round-robin, sharing a GPU's
`--gpu-memory-fraction` among the replicas on it (`gpu_placement.py`); `--device cpu` (and `auto`
without a GPU) is the CPU cluster it always was.
`LocalCluster` is the same thing as a context manager (no restarts): the one local cluster of the
demo, the serving benchmark and the cluster tests. Processes and their stop: `processes.py`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from pdcluster.cluster.engine import ENGINES, EngineSpec
from pdcluster.cluster.extra_flags import check_router_flag_names
from pdcluster.cluster.gpu_placement import DeviceSlot, place_on_devices
from pdcluster.cluster.placement import Placement
from pdcluster.cluster.processes import (
    REPLICA_READY,
    ROUTER_READY,
    Proc,
    parse_router_ready,
    pdcluster_argv,
    spawn,
    stop_procs,
)
from pdcluster.cluster.replica_process import free_ports
from pdcluster.cluster.supervisor import RestartPolicy, supervise
from pdcluster.discovery.discover import visible_gpu_count
from replica.config import DType, check_device_name
from router import strategies
from router.config import Strategy
from router.models import parse_model
from router.scaling import policies
from transfer.fabric import FABRIC_CHOICES, needs_store


@dataclass
class UpConfig:
    """Flags of `pdcluster up`."""

    model: Path = field(metadata={
        "help": "checkpoint folder (--engine simulated: only its tokenizer is read)"})
    models: list[str] = field(default_factory=list, metadata={"help": (
        "more models beside --model, NAME=DIR[,min-prefill=N,...] each (the router's --models): folders "
        "beside --model's (the replicas' model root); every replica starts with --model, inactive ones "
        "are shared and load whichever model needs them")})
    prefill: int = field(default=1, metadata={"help": "prefill replicas"})
    decode: int = field(default=1, metadata={"help": "decode replicas"})
    inactive: int = field(default=0, metadata={"help": "inactive replicas (no weights; scale-up targets)"})
    strategy: str = field(default=Strategy.FULL.value, metadata={
        "help": "migration strategy (a name registered in router/strategies/)"})
    scaling: str = field(default="static", metadata={"help": (
        "scaling policy of the router: static, multicast, live, stop-the-world, host-cache")})
    http_port: int = field(default=8080, metadata={"help": "router HTTP port (0 = free port)"})
    admin_port: int = field(default=50100, metadata={"help": "router admin gRPC port (0 = free port)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address every process binds"})
    num_blocks: int | None = field(default=None, metadata={"help": (
        "KV pages per replica; unset = 512 (torch), what the GPU's memory leaves after the weights "
        "(simulated)")})
    admin_token: str = field(default="", metadata={"help": "admin token of the router (empty = none)"})
    log_dir: Path | None = field(default=None, metadata={"help": "folder of process logs; unset = temp"})
    ready_timeout: float = field(default=180.0, metadata={"help": "seconds to wait for each ready line"})
    torch_threads: int = field(default=0, metadata={"help": (
        "torch threads per replica; 0 = this machine's cores shared among the replicas (at least 1)")})
    pin_decode: bool = field(default=False, metadata={"help": (
        "give each decode replica's engine thread a CPU core of its own (`--engine-cpus`; the router, the "
        "prefill and inactive replicas and the decode replicas' other threads and gRPC front processes "
        "share the other cores), as each would have its own device in a real deployment")})
    router_flag: list[str] = field(default_factory=list, metadata={"help": (
        "more router flags, NAME=VALUE each (e.g. min-prefill=1 max-prefill=3 keep-alive=5 "
        "timeline=/tmp/t.jsonl ignore-unknown-fields=true; a boolean's true / false is --NAME / "
        "--no-NAME; see `pdcluster router --help`)")})
    link_gbps: float = field(default=0.0, metadata={"help": (
        "emulated NIC of each replica, Gbit/s: every replica is its own node and the transfer "
        "fabric paces KV and weights to this rate (0 = loopback speed)")})
    fabric: str = field(default="tcp", metadata={"choices": list(FABRIC_CHOICES), "help": (
        "transfer fabric of every replica (see `pdcluster replica --help`); for nccl, rdma and auto "
        "this process serves the rendezvous store (a TCPStore named in the rank table) while it runs")})
    disk_gbps: float = field(default=0.0, metadata={"help": (
        "emulated disk of LoadParams, Gbit/s (0 = unpaced)")})
    host_gbps: float = field(default=0.0, metadata={"help": (
        "emulated host-memory bandwidth of LoadParams from host memory, Gbit/s (0 = unpaced)")})
    host_cache: bool = field(default=False, metadata={"help": (
        "inactive replicas keep the checkpoint in host memory from the start (the host-cache baseline)")})
    host_cache_bytes: int = field(default=0, metadata={"help": (
        "bytes of host memory each replica's node keeps weight copies in, least recently used evicted "
        "(a model larger than this misses and loads from disk); 0 = unlimited")})
    tls_cert: Path | None = field(default=None, metadata={"help": (
        "PEM certificate of --host for every process: TLS on every gRPC port and HTTPS "
        "(`pdcluster make-certs DIR --host HOST`)")})
    tls_key: Path | None = field(default=None, metadata={"help": "PEM private key of --tls-cert"})
    tls_ca: Path | None = field(default=None, metadata={"help": (
        "PEM CA the processes verify each other with (DIR/ca.crt)")})
    tls_client_ca: Path | None = field(default=None, metadata={"help": (
        "PEM CA every server requires client certificates from (mutual TLS)")})
    cluster_token: str = field(default="", metadata={"help": (
        "cluster token of the replicas, passed to them and the router in a file (empty = none)")})
    cluster_token_file: Path | None = field(default=None, metadata={"help": (
        "file holding the cluster token")})
    engine: str = field(default="torch", metadata={"help": (
        "torch: replicas run the checkpoint; simulated: they behave like --gpu running --model-card "
        "(replica/engine/sim/README.md)"), "choices": list(ENGINES)})
    gpu: str = field(default="a100-80g", metadata={"help": "simulated GPU (replica/engine/sim/gpus.py)"})
    model_card: str = field(default="llama-2-7b", metadata={"help": (
        "simulated model: a built-in card (replica/engine/sim/cards.py) or a config.json file")})
    byte_scale: str = field(default="1/256", metadata={"help": (
        "simulated weights, KV pages and link rates are the card's and the flags' times this")})
    profile: Path | None = field(default=None, metadata={"help": (
        "simulated step times from this profile table (replica/engine/sim/profile.py)")})
    max_restarts: int = field(default=3, metadata={"help": (
        "restarts of one replica within --restart-window before `up` stops everything and exits 1")})
    restart_window: float = field(default=300.0, metadata={"help": "seconds over which restarts are counted"})
    device: str = field(default="auto", metadata={"help": (
        "torch engine: cpu, cuda (one replica per visible GPU, round-robin: more replicas than GPUs "
        "share them), cuda:N (all on GPU N) or auto (cuda where a GPU is visible, else cpu)")})
    gpu_memory_fraction: float = field(default=0.9, metadata={"help": (
        "the share of each GPU its replicas take together; replicas sharing one GPU split it evenly")})
    dtype: str = field(default="", metadata={"help": (
        "torch engine: the replicas' weight and KV dtype, float32, bfloat16 or float16 (empty: each "
        "device's default, float32 on the CPU and bfloat16 on CUDA)")})
    routing: str = field(default="cache-aware", metadata={"choices": ["cache-aware", "load"], "help": (
        "the router's --routing: cache-aware (a prompt to the replica holding its longest cached "
        "prefix, within --routing-max-load) or load (the least loaded)")})
    tp: int = field(default=1, metadata={"help": (
        "torch engine: tensor-parallel degree of every replica (`pdcluster replica --tp`): a group of "
        "processes on consecutive GPUs (or CPU slices); such replicas move no KV or weights yet, so "
        "give only prefill or only decode replicas (they serve colocated) and no --inactive")})
    prefix_cache: bool = field(default=True, metadata={"help": (
        "the replicas' automatic prefix caching (--no-prefix-cache: every prompt computed whole)")})

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if self.max_restarts < 0 or self.restart_window <= 0:
            raise ValueError("--max-restarts must be >= 0 and --restart-window > 0")
        self.strategy = strategies.get(self.strategy).name  # an unknown name → ValueError naming them
        policies.get(self.scaling)
        if min(self.prefill, self.decode, self.inactive) < 0 or self.prefill + self.decode < 1:
            raise ValueError("need at least one prefill or decode replica, and no negative counts")
        bad = [f for f in self.router_flag if "=" not in f or f.startswith("-")]
        if bad:
            raise ValueError(f"--router-flag takes NAME=VALUE (without dashes), got {bad}")
        check_router_flag_names(self.router_flag)
        self._check_models()
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if (self.tls_cert is not None or self.tls_client_ca is not None) and self.tls_ca is None:
            raise ValueError("--tls-cert and --tls-client-ca need --tls-ca: the router verifies the "
                             "replicas with it")
        if self.cluster_token and self.cluster_token_file is not None:
            raise ValueError("give --cluster-token or --cluster-token-file, not both")
        self.engine_spec()  # an unknown GPU or card, a bad scale → ValueError naming it
        check_device_name(self.device)
        if self.fabric == "cuda-ipc" and self.link_gbps:
            raise ValueError("--fabric cuda-ipc joins replicas on one host, but --link-gbps makes every "
                             "replica its own node: use --fabric tcp or auto")
        if self.host_cache_bytes < 0:
            raise ValueError(f"--host-cache-bytes must be >= 0 (0 = unlimited), got {self.host_cache_bytes}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.dtype and self.dtype not in {d.value for d in DType}:
            known = ", ".join(d.value for d in DType)
            raise ValueError(f"--dtype must be one of {known}, got {self.dtype!r}")
        if self.dtype and self.engine != "torch":
            raise ValueError("--dtype is for the torch engine; simulated replicas take their card's")
        if self.tp < 1 or (self.tp > 1 and self.engine != "torch"):
            raise ValueError(f"--tp must be >= 1, and > 1 only for the torch engine (got {self.tp}, "
                             f"{self.engine})")
        if self.engine != "torch" and self.device not in ("auto", "cpu"):
            raise ValueError(f"--device {self.device} is for the torch engine; simulated replicas use none")
        if self.inactive and self.engine == "torch" and not (self.model / "config.json").is_file():
            raise ValueError(f"--inactive replicas load from the model root, but {self.model} has no "
                             "config.json the replicas can read")

    def _check_models(self) -> None:
        root = self.model.resolve().parent
        for spec in (parse_model(m) for m in self.models):  # a malformed entry → ValueError
            if spec.path.resolve().parent != root:
                raise ValueError(f"--models {spec.name}: {spec.path} must sit beside {self.model} (in "
                                 f"{root}, the replicas' model root: LoadParams finds it by its folder name)")
        if self.models and self.engine != "torch":
            raise ValueError("--models needs the torch engine")

    def router_args(self) -> list[str]:
        """The router flags of `--scaling`, `--routing` and `--router-flag` (a boolean flag as the
        cluster file writes it: `NAME=true` is `--NAME`, `NAME=false` is `--no-NAME`)."""
        args = ["--scaling", self.scaling, "--routing", self.routing]
        if self.models:
            args += ["--models", *(_resolved(m) for m in self.models)]
        for flag in self.router_flag:
            name, _, value = flag.partition("=")
            if value.lower() in ("true", "false"):
                args.append(f"--{name}" if value.lower() == "true" else f"--no-{name}")
            else:
                args += [f"--{name}", value]
        return args

    def tls_args(self) -> list[str]:
        """The TLS flags every process gets (same certificate: they all run on --host)."""
        args: list[str] = []
        for name in ("tls_cert", "tls_key", "tls_ca", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None:
                args += [f"--{name.replace('_', '-')}", str(Path(path).resolve())]
        return args

    def engine_spec(self) -> EngineSpec:
        """The replicas' engine."""
        return EngineSpec(self.engine, self.gpu, self.model_card, self.byte_scale, self.profile)

    def replica_args(self) -> list[str]:
        """The replica flags of the engine and the emulated devices."""
        args: list[str] = self.engine_spec().replica_args()
        if self.engine == "simulated":
            args.append("--no-grpc-frontend")  # a sleeping engine holds no GIL: one process is enough
        if self.dtype:
            args += ["--dtype", self.dtype]
        if not self.prefix_cache:
            args.append("--no-prefix-cache")
        if self.tp > 1:
            args += ["--tp", str(self.tp)]
        if self.disk_gbps:
            args += ["--disk-gbps", str(self.disk_gbps)]
        if self.host_gbps:
            args += ["--host-gbps", str(self.host_gbps)]
        if self.host_cache_bytes:
            args += ["--host-cache-bytes", str(self.host_cache_bytes)]
        if self.models:  # room in every replica's weight buffer for the largest model it may hold
            folders = [self.model, *(parse_model(m).path for m in self.models)]
            args += ["--weight-buffer-models", *(str(Path(f).resolve()) for f in folders)]
        return args


def _tp_group(rank: int, tp: int) -> int | None:
    """The `tp_group` of global rank `rank` when every replica is a group of `tp` ranks: its rank 0's
    rank for ranks 1.. of a group, None for a rank 0."""
    return rank - rank % tp if rank % tp else None


class LocalCluster:
    """Start replicas and a router as subprocesses; `stop()` ends every one of them."""

    def __init__(self, config: UpConfig) -> None:
        # The children start in SOURCE_ROOT: a path relative to the caller's folder must not change meaning.
        self.config = dataclasses.replace(config, model=config.model.resolve(),
                                          log_dir=config.log_dir.resolve() if config.log_dir else None)
        self.log_dir = self.config.log_dir or Path(tempfile.mkdtemp(prefix="pdcluster-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas: list[Proc] = []
        self.router: Proc | None = None
        self.http_url = ""
        self.admin_address = ""
        self.model_dir = config.model  # the router's --model (a simulated engine's: made by start)
        self.placement = Placement.plan(config.decode) if config.pin_decode else None
        self.devices: tuple[DeviceSlot, ...] = ()  # each replica's device, by rank (set by start)
        self.policy = RestartPolicy(config.max_restarts, config.restart_window)
        self._store: object | None = None  # the rendezvous store (TCPStore) served for nccl/rdma/auto

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
                 ) -> None:
        self.stop()

    def _spawn(self, name: str, role: str, args: list[str], ready: str, cpus: frozenset[int] | None = None
               ) -> Proc:
        return spawn(name, role, pdcluster_argv(*args), self.log_dir / f"{name}.log", cpus, ready)

    def _cpus(self, role: str, decode_index: int) -> frozenset[int] | None:
        """The cores of one process (None: not pinned); a decode replica puts its engine thread on its
        own core and the rest of itself on the shared ones (`_engine_args`)."""
        if self.placement is None:
            return None
        if role == "decode":
            return self.placement.shared | self.placement.decode[decode_index]
        return self.placement.shared

    def _engine_args(self, role: str, decode_index: int) -> list[str]:
        """`--engine-cpus CORE` of a pinned decode replica (nothing otherwise)."""
        if self.placement is None or role != "decode":
            return []
        return ["--engine-cpus", *map(str, sorted(self.placement.decode[decode_index]))]

    def roles(self) -> list[str]:
        """The role of each replica, by rank."""
        c = self.config
        return ["prefill"] * c.prefill + ["decode"] * c.decode + ["inactive"] * c.inactive

    def start(self) -> None:
        """Start every replica, wait for their ready lines, then the router and its ready line."""
        c = self.config
        # Replicas on one machine would each take every core and thrash: share them out instead (a pinned
        # decode replica has one core).
        shared = max(1, (os.cpu_count() or 1) // len(self.roles()))
        threads = c.torch_threads or (1 if self.placement else shared)
        # Fixed gRPC ports (not --port 0): a restarted replica comes back where the router looks for it.
        n = len(self.roles())
        # drawn together: a gRPC and a transfer port never coincide; a transfer port per rank of a tp group
        drawn = free_ports(n + n * c.tp, c.host)
        ports, fabric = drawn[:n], self._fabric_args(drawn[n:])
        security = c.tls_args() + self._token_args()
        engine = c.engine_spec()
        self.model_dir = engine.model_folder(c.model, self.log_dir / "model" / engine.model_card)
        pages = c.num_blocks if engine.simulated else (c.num_blocks or 512)
        self.devices = self.place_devices()
        common = [*(["--num-blocks", str(pages)] if pages else []), "--torch-threads", str(threads), *fabric,
                  *c.replica_args(), *security]
        for rank, role in enumerate(self.roles()):
            args = self.replica_argv(rank, role, ports[rank], common)
            cpus = self._cpus(role, rank - c.prefill)
            self.replicas.append(self._spawn(f"replica-{rank}-{role}", role, args, REPLICA_READY, cpus))
        deadline = time.monotonic() + c.ready_timeout
        for proc in self.replicas:
            proc.address = proc.wait_ready(deadline)[len(REPLICA_READY):].strip()
        args = ["router", "--model", str(self.model_dir), "--host", c.host, "--http-port", str(c.http_port),
                "--admin-port", str(c.admin_port), "--strategy", c.strategy, *c.router_args(),
                "--replica", *[p.address for p in self.replicas], "--role", *self.roles(), *security]
        if c.admin_token:
            args += ["--admin-token", c.admin_token]
        self.router = self._spawn("router", "router", args, ROUTER_READY, self._cpus("router", 0))
        line = self.router.wait_ready(time.monotonic() + c.ready_timeout)
        self.http_url, self.admin_address = parse_router_ready(line)

    def replica_argv(self, rank: int, role: str, port: int, common: list[str]) -> list[str]:
        """`pdcluster replica` arguments of replica `rank` (`common`: the flags every replica gets;
        its device from `self.devices`, set by `place_devices`)."""
        c = self.config
        args = ["replica", "--model", str(self.model_dir), "--host", c.host, "--port", str(port),
                "--rank", str(rank * c.tp), *common,  # a tp group holds ranks rank*tp .. rank*tp + tp - 1
                *(self.devices[rank].replica_args() if self.devices else [])]
        if role == "inactive":
            args += ["--inactive", *(["--host-cache"] if c.host_cache else [])]
        return args + self._engine_args(role, rank - c.prefill)

    def place_devices(self) -> tuple[DeviceSlot, ...]:
        """Each torch replica's device (`gpu_placement.py`); none for simulated replicas. GPUs are
        counted (nvidia-smi, no torch) only when `--device` is not cpu."""
        c = self.config
        if c.engine != "torch":
            return ()
        gpus = 0 if c.device == "cpu" else visible_gpu_count()
        return place_on_devices(len(self.roles()), c.device, gpus, c.gpu_memory_fraction, c.tp)

    def _token_args(self) -> list[str]:
        """`--cluster-token-file FILE` (a --cluster-token is written to an owner-only file in the log
        folder, so it never shows in the process list); nothing without a token."""
        c = self.config
        if c.cluster_token_file is not None:
            return ["--cluster-token-file", str(Path(c.cluster_token_file).resolve())]
        if not c.cluster_token:
            return []
        path = self.log_dir / "cluster-token"
        path.unlink(missing_ok=True)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(c.cluster_token + "\n")
        return ["--cluster-token-file", str(path.resolve())]

    def _fabric_args(self, ports: list[int]) -> list[str]:
        """`--cluster RANKS --fabric tcp`: this machine's rank table (rank i's transfer port: ports[i]).
        Under `--tp N` replica k is the group of global ranks k*N .. k*N + N - 1, an entry each."""
        from transfer.ranktable import RankTable

        tp = self.config.tp
        table = RankTable.local(ports, self.config.host)
        if tp > 1:  # ranks 1.. of each group name it (their own fabric endpoints, `replica/tp`)
            table = RankTable(tuple(dataclasses.replace(e, tp_group=_tp_group(e.rank, tp)) for e in table))
        if self.config.link_gbps:  # every replica (its group's ranks together) its own node behind a NIC
            gbps = self.config.link_gbps
            table = RankTable(tuple(dataclasses.replace(e, node=f"n{e.rank // tp}", link_gbps=gbps)
                                    for e in table.entries))
        if needs_store(self.config.fabric):  # nccl/rdma meet through a store that outlives every replica
            from transfer.store import serve_store

            self._store, address = serve_store(self.config.host)
            table = dataclasses.replace(table, store=address)
        path = self.log_dir / "ranks.json"
        path.write_text(table.to_json())
        return ["--cluster", str(path), "--fabric", self.config.fabric]

    def ready_line(self) -> str:
        """The one line `pdcluster up` prints once everything serves."""
        reps = " ".join(f"{p.role}@{p.address}" for p in self.replicas)
        pinned = f" pinned=({self.placement.describe()})" if self.placement else ""
        return (f"pdcluster up ready: http={self.http_url} admin={self.admin_address} "
                f"strategy={self.config.strategy} scaling={self.config.scaling}{self._engine_note()} "
                f"replicas=[{reps}] "
                f"logs={self.log_dir}{pinned}{self._device_note()}")

    def _device_note(self) -> str:
        """` devices=[cuda:0 cuda:0]` when on GPUs (nothing on the CPU: its line is as it was)."""
        if not any(slot.is_cuda for slot in self.devices):
            return ""
        return f" devices=[{' '.join(slot.device for slot in self.devices)}]"

    def _engine_note(self) -> str:
        engine = self.config.engine_spec()
        if not engine.simulated:
            return ""
        return f" engine=simulated:{engine.gpu}:{engine.model_card}:{engine.byte_scale}"

    def restart_replica(self, rank: int) -> Proc:
        """Start replica `rank` again after it exited (killed, say): the same flags, rank and gRPC port
        (fixed at start), so the router, which polls a dead replica's address, takes it back; its log
        is appended to. Returns at once; wait for it with `wait_replica`. Call it from a thread that
        outlives the replica: Linux sends the parent-death signal when the *thread* that spawned a
        child exits (a worker thread of `asyncio.to_thread` would take the replica down with it)."""
        proc = self.replicas[rank]
        if proc.running:
            raise RuntimeError(f"{proc.name} is still running")
        proc.respawn()
        return proc

    def restart_router(self) -> None:
        """Start the router again after it exited, on the same HTTP and admin ports, against the same
        replicas (it clears what they still cache for the router that died); returns once it is ready.
        Call it from a thread that outlives the router (see `restart_replica`)."""
        proc = self.router
        if proc is None or proc.running:
            raise RuntimeError("the router is not started, or still running")
        argv = proc.argv
        argv[argv.index("--http-port") + 1] = self.http_url.rsplit(":", 1)[1]
        argv[argv.index("--admin-port") + 1] = self.admin_address.rsplit(":", 1)[1]
        proc.respawn()
        self.http_url, self.admin_address = parse_router_ready(
            proc.wait_ready(time.monotonic() + self.config.ready_timeout))

    def wait_replica(self, proc: Proc, timeout: float | None = None) -> None:
        """Return once a (re)started replica serves (RuntimeError if it exits or is late)."""
        proc.wait_ready(time.monotonic() + (timeout or self.config.ready_timeout))

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the router, then the replicas; SIGKILL whatever is still alive after `timeout`."""
        stop_procs([self.router] if self.router else [], self.replicas, timeout=timeout)

    def lost(self) -> str:
        """Never lost for good on one machine: the restart budget decides."""
        return ""

    def changed(self) -> None:
        """Nothing records a local cluster's state."""

    def failed(self, message: str) -> None:
        """Said on stderr by the supervisor already."""


def run(config: UpConfig) -> int:
    """Entry point of `pdcluster up`: start, print the ready line, run until Ctrl-C / SIGTERM."""
    return supervise("pdcluster up", LocalCluster(config))


def _resolved(entry: str) -> str:
    """A `--models` entry with its folder made absolute (the router runs elsewhere)."""
    spec = parse_model(entry)
    options = entry.split(",")[1:]
    return ",".join([f"{spec.name}={spec.path.resolve()}", *options])
