"""`ReplicaConfig`: everything one `pdcluster replica` process is told; the CLI is generated from it.

Pure Python (no torch, no grpc): `pdcluster --help` imports this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path


class DType(enum.Enum):
    """Weight (and KV cache) element type."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


def check_device_name(device: str) -> None:
    """Refuse a `--device` that is not cpu, cuda, cuda:N or auto (whether it exists is checked at start)."""
    kind, _, index = device.partition(":")
    if device in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return
    raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")


class EngineKind(enum.Enum):
    """What computes: the model with torch, or a named GPU's modelled step times (no torch)."""

    TORCH = "torch"
    SIMULATED = "simulated"


@dataclass(frozen=True)
class ReplicaConfig:
    """Configuration of one replica process (rank 0 of a tensor-parallel group of --tp processes)."""

    port: int = field(metadata={"help": "gRPC port on --host; 0 picks a free port (printed once ready)"})
    model: Path | None = field(
        default=None,
        metadata={"help": "checkpoint folder (config.json, *.safetensors, tokenizer.json); with "
                          "--engine simulated only its tokenizer.json is read (optional there)"},
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    rank: int = field(default=0, metadata={"help": "this process's global rank in the rank table"})
    tp: int = field(
        default=1,
        metadata={"help": "tensor-parallel degree: this process is rank 0 of a group of --tp processes "
                          "(one per device: cuda:i+r, or a slice of the CPU cores) that it starts "
                          "and drives over torch.distributed (gloo on the CPU, NCCL on CUDA); needs "
                          "--num-blocks"},
    )
    tp_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds a tensor-parallel collective may take before the step fails "
                          "(UNAVAILABLE)"},
    )
    num_blocks: int | None = field(
        default=None,
        metadata={"help": "KV pages in the cache; unset = sized from free memory x --kv-memory-fraction"},
    )
    kv_memory_fraction: float = field(
        default=0.05,
        metadata={"help": "fraction of the memory left after the profile run given to the KV cache"},
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    dtype: DType | None = field(
        default=None,
        metadata={"help": "weight and KV cache dtype; unset = float32 on the CPU, bfloat16 on CUDA"},
    )
    device: str = field(
        default="auto",
        metadata={"help": "where the engine runs: cpu, cuda, cuda:N, or auto (cuda:0 where CUDA is "
                          "present, else cpu)"},
    )
    gpu_memory_fraction: float = field(
        default=0.9,
        metadata={"help": "CUDA: the share of the device's memory this replica may take (weights, "
                          "activations and KV pages), so several replicas can share one GPU"},
    )
    cuda_graphs: bool = field(
        default=True,
        metadata={"help": "CUDA: capture decode steps as CUDA graphs at bucketed batch sizes at Warmup"},
    )
    cpu_onednn: bool = field(
        default=True,
        metadata={"help": "CPU float32: run the linear layers through oneDNN (faster on AVX-512 cores; "
                          "row counts padded to ~20 buckets whose kernels are built at start, so memory "
                          "stays flat); --no-cpu-onednn: torch's F.linear (MKL)"},
    )
    cpu_packed_weights: bool = field(
        default=True,
        metadata={"help": "with oneDNN (--cpu-onednn): keep a copy of the linear weights in oneDNN's "
                          "blocked layout (faster matmuls, the same results; twice the weights' memory)"},
    )
    prefix_cache: bool = field(
        default=True,
        metadata={"help": "automatic prefix caching: full KV pages kept by their chained hash after their "
                          "requests end and shared by later prompts with the same prefix (evicted LRU)"},
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "paged attention: torch (gather + SDPA, the reference), triton (a kernel over "
                          "the page table), or auto (triton on CUDA where it imports, else torch)",
                  "choices": ["auto", "torch", "triton"]},
    )
    max_input_tokens: int | None = field(
        default=None,
        metadata={"help": "longest prompt accepted (after truncate); unset = the model's positions - 1"},
    )
    max_total_tokens: int | None = field(
        default=None,
        metadata={"help": "longest prompt + max_new_tokens accepted; unset = the model's positions"},
    )
    max_batch_prefill_tokens: int = field(
        default=4096,
        metadata={"help": "most prompt tokens in one prefill batch (also the Warmup profile run's size)"},
    )
    model_id: str = field(default="", metadata={"help": "name reported by Info; empty = the folder's name"})
    grpc_workers: int = field(default=16, metadata={"help": "threads serving gRPC calls"})
    grpc_frontend: bool = field(
        default=True,
        metadata={
            "help": "serve gRPC from a helper process so its Python work does not hold the engine's GIL"
        },
    )
    router: str = field(
        default="",
        metadata={"help": "router admin address HOST:PORT to register with and heartbeat; empty = none"},
    )
    role: str = field(
        default="",
        metadata={
            "help": "role announced to the router on registration (empty = let the router decide)",
            "choices": ["", "prefill", "decode", "colocated", "inactive"],
        },
    )
    router_token: str = field(
        default="", metadata={"help": "admin token for the router's registration calls"}
    )
    tls_cert: Path | None = field(
        default=None, metadata={"help": "PEM certificate: serve gRPC over TLS (`pdcluster make-certs`)"}
    )
    tls_key: Path | None = field(default=None, metadata={"help": "PEM private key of --tls-cert"})
    tls_ca: Path | None = field(
        default=None,
        metadata={"help": "PEM CA that signed the router's certificate: register with it over TLS"},
    )
    tls_client_ca: Path | None = field(
        default=None,
        metadata={"help": "PEM CA: callers must present a certificate it signed (mutual TLS)"},
    )
    cluster_token: str = field(
        default="",
        metadata={"help": "secret every state-changing RPC must carry as `x-cluster-token` metadata "
                          "(all but Health, Info, ServiceDiscovery); empty = none"},
    )
    cluster_token_file: Path | None = field(
        default=None, metadata={"help": "file holding the cluster token (kept out of the process list)"}
    )
    torch_threads: int = field(
        default=0,
        metadata={
            "help": "intra-op threads of torch on the CPU; 0 = torch's default (one per --engine-cpus core)"
        },
    )
    engine_cpus: list[int] = field(
        default_factory=list,
        metadata={
            "help": "CPU cores for the engine thread alone; the replica's other threads and its gRPC front "
            "process run on the other cores it may use (replica/placement.py); empty = no placement",
        },
    )
    # --- moving state between replicas (issue 4) ---
    fabric: str = field(
        default="tcp",
        metadata={"help": "transfer fabric for KV and weights: tcp (device buffers staged through host "
                          "memory); cuda-ipc (ranks on one host: device to device, control on tcp); "
                          "nccl / rdma (device buffers on it, control on tcp; the rank table's store for "
                          "rendezvous); auto = cuda-ipc for CUDA buffers with every rank on this node, "
                          "nccl or rdma across nodes, else tcp",
                  "choices": ["tcp", "cuda-ipc", "nccl", "rdma", "auto"]},
    )
    cluster: Path | None = field(
        default=None,
        metadata={"help": "rank table file (rank -> host, node, device, transfer address); unset = no peers"},
    )
    inactive: bool = field(
        default=False,
        metadata={"help": "start with the weight buffer allocated but nothing loaded (a scale-up target)"},
    )
    model_root: Path | None = field(
        default=None,
        metadata={
            "help": "LoadParams from disk may read only under this folder; unset = the --model's parent"
        },
    )
    disk_gbps: float = field(
        default=0.0,
        metadata={"help": "emulated disk bandwidth of LoadParams from disk, Gbit/s (0 = unpaced; "
                          "e.g. 16 for a 2 GB/s NVMe, scaled like the model)"},
    )
    host_gbps: float = field(
        default=0.0,
        metadata={"help": "emulated host-memory bandwidth of LoadParams from host memory, Gbit/s "
                          "(0 = unpaced; e.g. 200 for 25 GB/s)"},
    )
    host_cache: bool = field(
        default=False,
        metadata={"help": "keep the checkpoint (--model) in host memory from the start, so "
                          "LoadParams LOAD_FROM_HOST_MEM works before any ResetStatus (host-cache baseline)"},
    )
    host_cache_bytes: int = field(
        default=0,
        metadata={"help": "bytes of host memory this node keeps weight copies in (least recently used "
                          "evicted; a model larger than this is never kept, so LoadParams from host "
                          "memory misses); 0 = unlimited. Simulated: full-size bytes (scaled like the "
                          "weights)"},
    )
    weight_buffer_bytes: int = field(
        default=0,
        metadata={"help": "bytes of the weight buffer (0 = the --model's size): room for the largest "
                          "model this replica may hold; LoadParams or a transfer naming a model of "
                          "another shape lays the buffer and the KV pages out for it (torch engine, "
                          "--tp 1); a model larger than the buffer is refused"},
    )
    weight_buffer_models: list[Path] = field(
        default_factory=list,
        metadata={"help": "checkpoint folders this replica may hold (several models per cluster): the "
                          "weight buffer gets room for the largest of them in this replica's dtype "
                          "(with --weight-buffer-bytes: the larger of the two)"},
    )
    allow_set_status_ready: bool = field(
        default=False,
        metadata={"help": "let SetStatusReady mark the weights loaded without moving them (tests, mocks)"},
    )
    transfer_timeout: float = field(
        default=60.0,
        metadata={"help": "seconds a transfer may wait on a peer before failing (every wait has a deadline)"},
    )
    # --- a simulated GPU (replica/engine/sim/README.md) ---
    engine: EngineKind = field(
        default=EngineKind.TORCH,
        metadata={"help": "torch: run the checkpoint; simulated: behave like --gpu running --model-card "
                          "(modelled step times, deterministic tokens, scaled bytes; no torch)"},
    )
    gpu: str = field(
        default="a100-80g",
        metadata={"help": "simulated GPU: a100-80g, a100-40g, h100-80g, h200, l40s, l4, a10, ... "
                          "(replica/engine/sim/gpus.py: peak compute, memory bandwidth, memory)"},
    )
    model_card: str = field(
        default="llama-2-7b",
        metadata={"help": "simulated model: a built-in card (replica/engine/sim/cards.py) or a file "
                          "(a Hugging Face config.json, or a card in JSON/TOML)"},
    )
    profile: Path | None = field(
        default=None,
        metadata={"help": "simulated step times from this profile table (CSV phase,batch_size,"
                          "context_len,ms) instead of the roofline model"},
    )
    byte_scale: str = field(
        default="1/256",
        metadata={"help": "simulated weights and KV pages hold the card's bytes times this (e.g. 1/256); "
                          "pace links at the same scale"},
    )
    compute_efficiency: float = field(
        default=0.6, metadata={"help": "simulated: the share of the GPU's peak FLOP/s a step reaches"}
    )
    memory_efficiency: float = field(
        default=0.8,
        metadata={"help": "simulated: the share of the GPU's peak memory bandwidth a step reaches"},
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={"help": "simulated: the share of GPU memory for weights + KV cache (the KV cache gets "
                          "what is left after the weights, unless --num-blocks)"},
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"--num-blocks must be positive, got {self.num_blocks}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"--kv-memory-fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        for name in ("max_input_tokens", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        check_device_name(self.device)
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.max_batch_prefill_tokens <= 0:
            raise ValueError(f"--max-batch-prefill-tokens must be > 0, not {self.max_batch_prefill_tokens}")
        if self.weight_buffer_bytes < 0:
            raise ValueError(f"--weight-buffer-bytes must be >= 0 (0 = the model's size), got "
                             f"{self.weight_buffer_bytes}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"--host-cache-bytes must be >= 0 (0 = unlimited), got {self.host_cache_bytes}")
        if self.disk_gbps < 0 or self.host_gbps < 0:
            raise ValueError(f"--disk-gbps and --host-gbps must be >= 0 ({self.disk_gbps}, {self.host_gbps})")
        if self.torch_threads < 0:
            raise ValueError(f"--torch-threads must be >= 0, got {self.torch_threads}")
        if any(cpu < 0 for cpu in self.engine_cpus) or len(set(self.engine_cpus)) != len(self.engine_cpus):
            raise ValueError(f"--engine-cpus must be distinct core numbers >= 0, got {self.engine_cpus}")
        if self.transfer_timeout <= 0:
            raise ValueError(f"--transfer-timeout must be positive, got {self.transfer_timeout}")
        if self.grpc_workers <= 0:
            raise ValueError(f"--grpc-workers must be positive, got {self.grpc_workers}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.cluster_token and self.cluster_token_file is not None:
            raise ValueError("give --cluster-token or --cluster-token-file, not both")
        if self.engine is EngineKind.TORCH and self.model is None:
            raise ValueError("--model is required (a checkpoint folder) unless --engine simulated")
        if self.engine is EngineKind.SIMULATED:
            self._check_simulated()
        self._check_tp()

    def _check_tp(self) -> None:
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.tp_timeout <= 0:
            raise ValueError(f"--tp-timeout must be positive, got {self.tp_timeout}")
        if self.tp == 1:
            return
        if self.engine is not EngineKind.TORCH:
            raise ValueError("--tp > 1 runs the torch engine only")
        if self.num_blocks is None:
            raise ValueError("--tp > 1 needs --num-blocks (every rank holds the same pages)")
        if self.inactive and self.cluster is None:
            raise ValueError("--tp > 1 --inactive needs --cluster: the weights come to every rank over its "
                             "own fabric endpoint (the group's ranks in the rank table)")

    def _check_simulated(self) -> None:
        if not 0 < self.scale <= 1:
            raise ValueError(f"--byte-scale must be in (0, 1], got {self.byte_scale}")
        for name in ("compute_efficiency", "memory_efficiency", "gpu_memory_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 1], got {getattr(self, name)}")

    @property
    def scale(self) -> float:
        """`--byte-scale` as a number ("1/256" or "0.00390625")."""
        try:
            return float(Fraction(self.byte_scale))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"--byte-scale must be a number or fraction, got {self.byte_scale!r}") from None

    @property
    def engine_tag(self) -> str:
        """What every response's `x-pdcluster-engine` metadata says ("" for the torch engine: none sent)."""
        if self.engine is EngineKind.TORCH:
            return ""
        return f"simulated; gpu={self.gpu}; model={self.name}; byte-scale={self.byte_scale}"

    @property
    def name(self) -> str:
        """The model id reported by Info (a simulated replica's default: its card's name)."""
        if self.model_id:
            return self.model_id
        if self.engine is EngineKind.SIMULATED:
            return Path(self.model_card).stem
        return Path(self.model or "").name
