"""The CUDA KV sizing path of the factory (profile run, activation peak, --gpu-memory-fraction),
run on the CPU with torch.cuda's memory queries stood in for: its arithmetic and control flow."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from replica.config import DType, ReplicaConfig
from replica.engine import factory
from replica.engine.device import DeviceChoice
from replica.engine.memory import CUDA_CONTEXT_BYTES
from replica.engine.validation import derive_limits
from replica.model.attention import PagedKVCache
from replica.model.llama import load_model

GIB = 1 << 30


@dataclass(frozen=True)
class _CudaOnCpu(DeviceChoice):
    """A CUDA choice whose tensors live on the CPU (the memory queries are monkeypatched)."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.fixture
def fake_cuda_memory(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    state = {"allocated": 2 * GIB, "peak": 0, "free": 60 * GIB, "total": 80 * GIB, "reserved": 3 * GIB}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=0))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    # the profile forward's activations: 1 GiB above what was allocated before it
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["allocated"] + GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    return state


def test_pages_from_the_fraction_after_weights_and_profile(
    tiny_model_factory: Callable[..., Path], fake_cuda_memory: dict[str, int]
) -> None:
    path = tiny_model_factory(arch="llama")
    config = ReplicaConfig(model=path, port=0, block_size=8, gpu_memory_fraction=0.5, max_total_tokens=64)
    model = load_model(path, torch.float32).model
    limits = derive_limits(config, model.config)
    choice = _CudaOnCpu(torch.device("cpu"), DType.FLOAT32, "torch", "fake")
    blocks = factory._num_blocks(config, choice, model, limits)
    # own share: 40 GiB - 2 GiB held - 1 GiB activations - the context; free: 60 + 3 - 2 - 1 GiB
    budget = 40 * GIB - 2 * GIB - GIB - CUDA_CONTEXT_BYTES
    assert blocks == budget // PagedKVCache.bytes_per_block(model.config, 8, torch.float32)
    fake_cuda_memory["free"] = 3 * GIB  # another process took the rest: free memory bounds it
    blocks = factory._num_blocks(config, choice, model, limits)
    assert blocks == 3 * GIB // PagedKVCache.bytes_per_block(model.config, 8, torch.float32)
    fake_cuda_memory["free"] = 0
    fake_cuda_memory["reserved"] = 0
    with pytest.raises(ValueError, match=r"--gpu-memory-fraction 0\.5 leaves no memory for KV pages"):
        factory._num_blocks(config, choice, model, limits)


def test_an_inactive_replica_estimates_the_activations(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory(arch="llama")
    config = ReplicaConfig(model=path, port=0, inactive=True)
    model = load_model(path, torch.float32).model
    limits = derive_limits(config, model.config)
    choice = _CudaOnCpu(torch.device("cpu"), DType.FLOAT32, "torch", "fake")
    estimate = factory._profile_activation_bytes(config, choice, model, limits)
    c = model.config
    per_token = 4 * 3 * c.intermediate_size + 4 * 4 * c.hidden_size + 4 * c.vocab_size
    assert estimate == limits.max_prefill_tokens * per_token


def test_meta_reports_graphs_only_with_the_kernel_on_cuda(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory(arch="llama")
    cuda = _CudaOnCpu(torch.device("cpu"), DType.BFLOAT16, "triton", "NVIDIA H100")
    meta = factory._meta(ReplicaConfig(model=path, port=0), cuda)
    assert (meta.cuda_graphs, meta.gpu_name, meta.dtype, meta.attention_backend) == (
        True, "NVIDIA H100", "bfloat16", "triton")
    assert not factory._meta(ReplicaConfig(model=path, port=0, cuda_graphs=False), cuda).cuda_graphs
    torch_path = _CudaOnCpu(torch.device("cpu"), DType.BFLOAT16, "torch", "NVIDIA H100")
    assert not factory._meta(ReplicaConfig(model=path, port=0), torch_path).cuda_graphs
    cpu = DeviceChoice(torch.device("cpu"), DType.FLOAT32, "torch", "")
    assert not factory._meta(ReplicaConfig(model=path, port=0), cpu).cuda_graphs
