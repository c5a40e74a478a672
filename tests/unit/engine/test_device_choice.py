"""`--device`, `--dtype` and `--attention-backend` resolution, and the CUDA KV budget's arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replica.config import DType, ReplicaConfig
from replica.engine import device as device_mod
from replica.engine import memory


def _config(**kw: object) -> ReplicaConfig:
    return ReplicaConfig(port=0, model=Path("/nonexistent"), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12", "auto"])
def test_device_names_accepted(name: str) -> None:
    assert _config(device=name).device == name


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", "cuda:0:1", "mps", ""])
def test_bad_device_names_refused_naming_the_flag(name: str) -> None:
    with pytest.raises(ValueError, match="--device"):
        _config(device=name)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_gpu_memory_fraction_bounds(fraction: float) -> None:
    with pytest.raises(ValueError, match="--gpu-memory-fraction"):
        _config(gpu_memory_fraction=fraction)


def test_auto_is_the_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_mod.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        device_mod.resolve_device("cuda")


def test_cuda_index_past_the_visible_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_mod.resolve_device("cuda") == torch.device("cuda", 0)
    assert device_mod.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="2 CUDA device"):
        device_mod.resolve_device("cuda:2")


def test_dtype_defaults_per_device() -> None:
    assert device_mod.default_dtype(torch.device("cpu")) is DType.FLOAT32
    assert device_mod.default_dtype(torch.device("cuda", 0)) is DType.BFLOAT16


def _cpu_auto() -> str:
    """What `auto` resolves to on the CPU: the native decode kernel where a compiler is."""
    from replica.model.compiled_attention import compiler_missing

    return "torch" if compiler_missing() else "native"


def test_cpu_choice_keeps_float32_and_the_native_kernel() -> None:
    choice = device_mod.choose(_config(device="cpu"))
    assert (choice.device, choice.dtype, choice.attention_backend, choice.gpu_name) == (
        torch.device("cpu"), DType.FLOAT32, _cpu_auto(), "")
    assert device_mod.choose(_config(device="cpu", dtype=DType.BFLOAT16)).torch_dtype is torch.bfloat16


def test_attention_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import replica.model.attention as attention

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(attention, "triton_available", lambda: None)
    assert device_mod.choose_attention("auto", cuda) == "triton"
    assert device_mod.choose_attention("auto", torch.device("cpu")) == _cpu_auto()
    assert device_mod.choose_attention("torch", cuda) == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        device_mod.choose_attention("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert device_mod.choose_attention("triton", torch.device("cpu")) == "triton"
    monkeypatch.setattr(attention, "triton_available", lambda: "triton is not installed")
    assert device_mod.choose_attention("auto", cuda) == "torch"
    with pytest.raises(ValueError, match="triton is not installed"):
        device_mod.choose_attention("triton", cuda)


GIB = 1 << 30
CONTEXT = memory.CUDA_CONTEXT_BYTES


@pytest.mark.parametrize(
    ("free", "total", "held", "reserved", "fraction", "activations", "expected"),
    [
        # alone on an 80 GiB device: 0.9 of it less 14 GiB of weights, 2 GiB of activations, the context
        (65 * GIB, 80 * GIB, 14 * GIB, 15 * GIB, 0.9, 2 * GIB, 72 * GIB - 16 * GIB - CONTEXT),
        # a second replica on the same device: its share (0.45) is the bound
        (30 * GIB, 80 * GIB, 14 * GIB, 14 * GIB, 0.45, 2 * GIB, 36 * GIB - 16 * GIB - CONTEXT),
        # what is free is the bound: another process took most of the device
        (10 * GIB, 80 * GIB, 14 * GIB, 14 * GIB, 0.9, 2 * GIB, 8 * GIB),
        # nothing left
        (1 * GIB, 80 * GIB, 14 * GIB, 14 * GIB, 0.9, 2 * GIB, 0),
    ],
)
def test_cuda_kv_budget(monkeypatch: pytest.MonkeyPatch, free: int, total: int, held: int, reserved: int,
                        fraction: float, activations: int, expected: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: held)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    got = memory.cuda_kv_budget(torch.device("cuda", 0), fraction, activations)
    assert got == expected


def test_host_cache_copy_of_a_cpu_buffer_is_plain_host_memory() -> None:
    from replica.params.checkpoint import CheckpointIO

    buffer = torch.arange(64, dtype=torch.uint8)
    copy = CheckpointIO().empty_copy(buffer)
    assert copy.device.type == "cpu" and copy.shape == buffer.shape and copy.dtype == torch.uint8
    assert copy.data_ptr() != buffer.data_ptr()


@pytest.mark.parametrize("backend", ["compiled", "native"])
def test_cpu_kernels_fall_back_to_torch_without_a_compiler(
    backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from replica.model import compiled_attention

    cpu = torch.device("cpu")
    monkeypatch.setattr(compiled_attention, "compiler_missing", lambda: None)
    assert device_mod.choose_attention(backend, cpu) == backend
    monkeypatch.setattr(compiled_attention, "compiler_missing", lambda: "no C++ compiler: 'g++' not on PATH")
    with caplog.at_level("WARNING"):
        assert device_mod.choose_attention(backend, cpu) == "torch"
    assert "falls back to the torch path: no C++ compiler" in caplog.text
    with pytest.raises(ValueError, match=f"{backend} is the CPU decode kernel"):
        device_mod.choose_attention(backend, torch.device("cuda", 0))


def test_compiler_lookup_follows_cxx(monkeypatch: pytest.MonkeyPatch) -> None:
    from replica.model import compiled_attention

    monkeypatch.setenv("CXX", "/nonexistent/c++")
    compiled_attention.compiler_missing.cache_clear()
    try:
        assert "'/nonexistent/c++' is not on PATH" in (compiled_attention.compiler_missing() or "")
    finally:
        compiled_attention.compiler_missing.cache_clear()
