"""The start-up hint naming the `pdcluster[gpu-cuXX]` extra that matches the installed torch's CUDA."""

from __future__ import annotations

from replica.gpu_extras import extra_hint

CU13 = ["cupy-cuda13x", "nvidia-nccl-cu13"]
CU12 = ["cupy-cuda12x", "nvidia_nccl_cu12"]


def test_nothing_to_say_when_it_matches_or_torch_is_a_cpu_build() -> None:
    assert extra_hint("13.0", [*CU13, "numpy"]) is None
    assert extra_hint("12.8", CU12) is None
    assert extra_hint(None, []) is None and extra_hint("", CU12) is None


def test_missing_packages_name_the_extra() -> None:
    hint = extra_hint("13.0", ["nvidia-nccl-cu13"])
    assert hint == ("torch is built for CUDA 13.0 but cupy-cuda13x is not installed: install the extra "
                    "gpu-cu13 (pip install 'pdcluster[gpu-cu13]': cupy-cuda13x, nvidia-nccl-cu13) for the "
                    "nccl and cuda-ipc fabrics")
    assert "cupy-cuda12x and nvidia-nccl-cu12 are not installed" in str(extra_hint("12.4", []))


def test_a_mismatch_names_both() -> None:
    hint = str(extra_hint("13.0", CU12))
    assert "cupy-cuda13x and nvidia-nccl-cu13 are not installed" in hint
    assert "cupy-cuda12x (CUDA 12) and nvidia-nccl-cu12 (CUDA 12) are installed" in hint
    assert "gpu-cu13" in hint
    assert "cupy-cuda13x (CUDA 13) is installed" in str(extra_hint("12.1", [*CU12, "cupy-cuda13x"]))


def test_a_cuda_version_without_an_extra() -> None:
    assert "no extra (gpu-cu12, gpu-cu13)" in str(extra_hint("11.8", []))
