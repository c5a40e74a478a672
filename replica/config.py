"""`ReplicaConfig`: everything one `pdcluster replica` process is told; the CLI is generated from it.

Pure Python (no torch, no grpc): `pdcluster --help` imports this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path


class DType(enum.Enum):
    """Weight (and KV cache) element type."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


@dataclass(frozen=True)
class ReplicaConfig:
    """Configuration of one replica process (one device, tensor-parallel degree 1)."""

    model: Path = field(metadata={"help": "checkpoint folder (config.json, *.safetensors, tokenizer.json)"})
    port: int = field(metadata={"help": "gRPC port on --host; 0 picks a free port (printed once ready)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    rank: int = field(default=0, metadata={"help": "this process's global rank in the rank table"})
    num_blocks: int | None = field(
        default=None,
        metadata={"help": "KV pages in the cache; unset = sized from free memory x --kv-memory-fraction"},
    )
    kv_memory_fraction: float = field(
        default=0.05,
        metadata={"help": "fraction of the memory left after the profile run given to the KV cache"},
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    dtype: DType = field(default=DType.FLOAT32, metadata={"help": "weight and KV cache dtype"})
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
        metadata={"help": "transfer fabric for KV and weights", "choices": ["tcp", "nccl", "rdma"]},
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
    allow_set_status_ready: bool = field(
        default=False,
        metadata={"help": "let SetStatusReady mark the weights loaded without moving them (tests, mocks)"},
    )
    transfer_timeout: float = field(
        default=60.0,
        metadata={"help": "seconds a transfer may wait on a peer before failing (every wait has a deadline)"},
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
        if self.max_batch_prefill_tokens <= 0:
            raise ValueError(f"--max-batch-prefill-tokens must be > 0, not {self.max_batch_prefill_tokens}")
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

    @property
    def name(self) -> str:
        """The model id reported by Info."""
        return self.model_id or Path(self.model).name
