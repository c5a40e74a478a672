"""Which `pdcluster[gpu-cuXX]` extra matches the installed torch: the start-up hint of a CUDA replica.

The nccl and cuda-ipc fabrics use cupy and NCCL built for one CUDA major version; torch is built for
one too (`torch.version.cuda`). When the two disagree, or cupy/NCCL are missing, the replica says
which extra to install instead of failing later inside a fabric:

    torch is built for CUDA 13.0 but cupy-cuda13x is not installed and cupy-cuda12x (CUDA 12) is:
    install the extra gpu-cu13 (pip install 'pdcluster[gpu-cu13]': cupy-cuda13x, nvidia-nccl-cu13)

`extra_hint` is pure (tested with made-up versions); `gpu_extra_hint` reads this environment.
"""

from __future__ import annotations

from collections.abc import Collection

EXTRAS: dict[int, tuple[str, ...]] = {
    12: ("cupy-cuda12x", "nvidia-nccl-cu12"),
    13: ("cupy-cuda13x", "nvidia-nccl-cu13"),
}
"""CUDA major version -> the distributions of its extra `gpu-cu<major>` (pyproject.toml)."""


def _major(cuda: str) -> int | None:
    head = cuda.strip().split(".")[0]
    return int(head) if head.isdigit() else None


def extra_hint(torch_cuda: str | None, installed: Collection[str]) -> str | None:
    """What to install for this torch's CUDA version given the installed distributions (names as
    pip spells them); None when nothing is missing or mismatched, or torch is a CPU build."""
    if not torch_cuda:
        return None  # a CPU build of torch: no CUDA fabric to feed
    major = _major(torch_cuda)
    names = {n.lower().replace("_", "-") for n in installed}
    wanted = EXTRAS.get(major) if major is not None else None
    if wanted is None:
        known = ", ".join(f"gpu-cu{m}" for m in EXTRAS)
        return (f"torch is built for CUDA {torch_cuda}, for which pdcluster has no extra ({known}): "
                "install cupy and NCCL for that CUDA version by hand")
    missing = [n for n in wanted if n not in names]
    other = [f"{n} (CUDA {m})" for m, dists in EXTRAS.items() if m != major for n in dists if n in names]
    if not missing and not other:
        return None
    said = []
    if missing:
        said.append(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed")
    if other:
        said.append(f"{' and '.join(other)} {'is' if len(other) == 1 else 'are'} installed")
    return (f"torch is built for CUDA {torch_cuda} but {' and '.join(said)}: install the extra "
            f"gpu-cu{major} (pip install 'pdcluster[gpu-cu{major}]': {', '.join(wanted)}) for the nccl "
            "and cuda-ipc fabrics")


def gpu_extra_hint() -> str | None:
    """`extra_hint` for this environment (imports torch: call it where torch is loaded already)."""
    from importlib import metadata

    import torch

    names = [n for n in (d.metadata["Name"] for d in metadata.distributions()) if n]
    return extra_hint(torch.version.cuda, names)
