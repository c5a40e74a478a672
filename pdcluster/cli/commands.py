"""What `pdcluster` offers: one subcommand per process or tool, each a config dataclass and a runner.

A runner takes the filled-in config and returns the process exit code. Both are named by import path
("module:name"): the config classes are imported to build the parser (they are plain dataclasses),
a runner only when its subcommand runs, so `pdcluster --help` stays fast and a missing optional
extra breaks only its own subcommand. A name with a space is "group subcommand".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand: its one-line help, its config dataclass and its runner."""

    help: str
    config: str
    runner: str


COMMANDS: dict[str, Command] = {
    "replica": Command(
        "run one replica server process", "replica.config:ReplicaConfig", "replica.server.main:serve"
    ),
    "router": Command(
        "run the router (HTTP front end + admin gRPC)", "router.config:RouterConfig", "router.main:serve"
    ),
    "up": Command(
        "start a whole cluster on this machine",
        "pdcluster.cluster.local:UpConfig",
        "pdcluster.cluster.local:run",
    ),
    "launch": Command(
        "start the replicas of a cluster file on its nodes (ssh, Slurm srun or local), then the router",
        "pdcluster.cluster.launch:LaunchConfig",
        "pdcluster.cluster.launch:run",
    ),
    "status": Command(
        "show each replica of a launched cluster file: address, device, health, role at the router",
        "pdcluster.cluster.status:StatusConfig",
        "pdcluster.cluster.status:run_status",
    ),
    "down": Command(
        "stop everything a launch of a cluster file started, from any shell",
        "pdcluster.cluster.status:DownConfig",
        "pdcluster.cluster.status:run_down",
    ),
    "devices": Command(
        "list this node's CUDA devices (NUMA node, nearest NIC), NICs and CPU cores",
        "pdcluster.discovery.command:DevicesConfig",
        "pdcluster.discovery.command:run",
    ),
    "demo": Command(
        "set up a tiny model and cluster, serve a few requests",
        "pdcluster.cli.demo:DemoConfig",
        "pdcluster.cli.demo:run",
    ),
    "make-tiny-model": Command(
        "write a random-weight Hugging Face checkpoint with a locally trained tokenizer",
        "pdcluster.tools.tiny_model:TinyModelConfig",
        "pdcluster.tools.tiny_model:run",
    ),
    "make-certs": Command(
        "write a private CA and a TLS certificate per host (and client) into a folder",
        "pdcluster.tools.certs:MakeCertsConfig",
        "pdcluster.tools.certs:run",
    ),
    "wheelhouse": Command(
        "gather pdcluster's wheels and its dependencies' (not torch) for nodes without a package registry",
        "pdcluster.cluster.wheelhouse:WheelhouseConfig",
        "pdcluster.cluster.wheelhouse:run",
    ),
    "calibrate": Command(
        "time a model card's forward on this GPU into a profile table for --engine simulated --profile",
        "pdcluster.tools.calibrate:CalibrateConfig",
        "pdcluster.tools.calibrate:run",
    ),
    "bench replica": Command(
        "prefill/decode tokens/s over gRPC, in-process and with transformers",
        "pdcluster.bench.replica:BenchReplicaConfig",
        "pdcluster.bench.replica:run",
    ),
    "bench engine": Command(
        "offline batch decode tokens/s of the engine in-process, beside vLLM-CPU's offline LLM (--peer vllm)",
        "pdcluster.bench.engine:BenchEngineConfig",
        "pdcluster.bench.engine:run",
    ),
    "bench transfer": Command(
        "transfer-layer GB/s against raw sockets and gloo ceilings",
        "pdcluster.bench.transfer:BenchTransferConfig",
        "pdcluster.bench.transfer:run",
    ),
    "bench gpu-transfer": Command(
        "GPU state between two ranks of one host: cuda-ipc and staged tcp as ratios to their ceilings",
        "pdcluster.bench.gpu_transfer:BenchGpuTransferConfig",
        "pdcluster.bench.gpu_transfer:run",
    ),
    "bench migration": Command(
        "KV migration bytes/s against the fabric's p2p",
        "pdcluster.bench.migration:BenchMigrationConfig",
        "pdcluster.bench.migration:run",
    ),
    "bench load": Command(
        "checkpoint loading and weight multicast against raw reads and p2p",
        "pdcluster.bench.load:BenchLoadConfig",
        "pdcluster.bench.load:run",
    ),
    "bench gpu": Command(
        "decode and prefill on one device against its measured copy bandwidth and matmul rate",
        "pdcluster.bench.gpu_config:BenchGpuConfig",
        "pdcluster.bench.gpu:run",
    ),
    "bench grammar": Command(
        "a decode step's time with structured output (JSON Schema masks) against the same batch free",
        "pdcluster.bench.grammar:BenchGrammarConfig",
        "pdcluster.bench.grammar:run",
    ),
    "bench tp": Command(
        "a tensor-parallel group's decode step against one process on the same model, and the "
        "collectives' share of it",
        "pdcluster.bench.tp:BenchTpConfig",
        "pdcluster.bench.tp:run",
    ),
    "bench serving": Command(
        "end-to-end serving benchmark (TTFT, TPOT, ITL, goodput)",
        "pdcluster.bench.serving.bench:BenchServingConfig",
        "pdcluster.bench.serving.bench:run",
    ),
    "bench scaling": Command(
        "every scaling policy against one burst (P99 TTFT, replica-seconds, reaction time, bytes moved)",
        "pdcluster.experiment.scaling.bench:BenchScalingConfig",
        "pdcluster.experiment.scaling.bench:run",
    ),
    "bench soak": Command(
        "a local cluster under mixed traffic, admin churn and replica kills; fails on unbounded growth",
        "pdcluster.bench.soak.bench:BenchSoakConfig",
        "pdcluster.bench.soak.bench:run",
    ),
    "experiment run": Command(
        "run an experiment file's matrix of cells (resumable), then write its report",
        "pdcluster.experiment.cli:ExperimentRunConfig",
        "pdcluster.experiment.cli:run",
    ),
    "simulate": Command(
        "run an experiment file's matrix in virtual time (simulated GPUs, no processes, no sleeping)",
        "pdcluster.sim.cli:SimulateConfig",
        "pdcluster.sim.cli:run",
    ),
    "experiment report": Command(
        "rebuild an experiment's report and plots from its output folder",
        "pdcluster.experiment.cli:ExperimentReportConfig",
        "pdcluster.experiment.cli:report",
    ),
}

GROUPS: dict[str, str] = {
    "bench": "benchmarks; JSON results with --json",
    "experiment": "experiment matrices over strategies, policies, workloads and topologies",
}
"""The one-line help of each command group."""
