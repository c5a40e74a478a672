"""Which device a torch replica runs on, in which dtype, with which attention backend.

`--device auto` is CUDA device 0 where torch sees one and the CPU elsewhere, so a CPU machine keeps
its behaviour without a flag. Everything here is decided once at start-up and reported by Info.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from replica.config import DType, ReplicaConfig
from replica.gpu_extras import gpu_extra_hint

log = logging.getLogger(__name__)

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}


@dataclass(frozen=True)
class DeviceChoice:
    """The resolved `--device`, `--dtype` and `--attention-backend` of one replica."""

    device: torch.device
    dtype: DType
    attention_backend: str  # "torch" or "triton"
    gpu_name: str  # "" on the CPU

    @property
    def torch_dtype(self) -> torch.dtype:
        """The weight and KV cache element type."""
        return TORCH_DTYPES[self.dtype]

    @property
    def is_cuda(self) -> bool:
        """The engine runs on a CUDA device."""
        return self.device.type == "cuda"


def resolve_device(name: str) -> torch.device:
    """`--device` as a torch device; ValueError naming the problem when it does not exist here."""
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU build of torch)"
        raise ValueError(f"--device {name}: no CUDA device is visible (torch's CUDA version: {built})")
    device = torch.device(name if ":" in name else "cuda:0")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {name}: this node has {count} CUDA device(s) (0..{count - 1})")
    return device


def default_dtype(device: torch.device) -> DType:
    """bfloat16 on CUDA (the serving dtype), float32 on the CPU (exact against transformers)."""
    return DType.BFLOAT16 if device.type == "cuda" else DType.FLOAT32


def choose_attention(asked: str, device: torch.device) -> str:
    """The paged-attention backend: `auto` is the Triton kernel on CUDA where it can run, else torch."""
    if asked == "torch" or (asked == "auto" and device.type != "cuda"):
        return "torch"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton runs on CUDA (on the CPU only under TRITON_INTERPRET=1)")
    from replica.model.attention import triton_available

    reason = triton_available()
    if reason is None:
        return "triton"
    if asked == "triton":
        raise ValueError(f"--attention-backend triton: {reason}")
    log.warning("paged attention falls back to the torch path: %s", reason)
    return "torch"


def choose(config: ReplicaConfig) -> DeviceChoice:
    """Resolve the config's device, dtype and attention backend (on the engine thread, at start)."""
    device = resolve_device(config.device)
    gpu_name = ""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # per thread: the engine thread's kernels and graphs go there
        gpu_name = torch.cuda.get_device_name(device)
        hint = gpu_extra_hint()  # cupy / NCCL of another CUDA major, or none: say which extra fits
        if hint:
            log.warning("%s", hint)
    dtype = config.dtype or default_dtype(device)
    return DeviceChoice(device, dtype, choose_attention(config.attention_backend, device), gpu_name)
