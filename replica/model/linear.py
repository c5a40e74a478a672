"""`linear(x, weight, bias)`: the model's matmuls, through oneDNN for float32 on the CPU when a replica
asks for it (`--cpu-onednn`, `use_onednn`), else `F.linear`.

Off by default: a replica's resident memory grew by 65-185 MiB a minute under `bench soak` with
oneDNN on (new batch shapes keep adding to its state; the thread-count setting below is not the
cause), and not without it.

torch's `F.linear` on a float32 CPU tensor calls MKL's sgemm. On the project's machines (AMD EPYC,
AVX-512) oneDNN's inner-product primitive — what vLLM's CPU build runs its linears through — is
1.5–3× faster at every batch a replica sees (1 to 2,048 rows, the 54 M Llama's shapes; figures in
`docs/performance.md#replica`), and its results differ from MKL's only by float32 rounding (a few
1e-6 on unit-scale inputs). Other dtypes and devices keep `F.linear` (bfloat16 on the CPU already
goes through oneDNN there).

Packed weights (`pack` / `unpack`): handed the plain weight, oneDNN reorders it into its blocked
layout on every call; a copy reordered once (`mkldnn._reorder_linear_weight`, what vLLM's
`onednn_mm` and torch's inductor keep) skips that and gives the same bits, 20-25 % faster at batch
32. It costs a second copy of the weights' bytes, and it is only right while the plain bytes do not
change: the engine packs a loaded model and drops the packs when its weights are reset
(`replica/engine/packing.py`). Packs are found by the plain weight's identity; a weight without
one is read in place, as it is at this call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F

# torch builds without oneDNN (or without these ops) fall back to F.linear / plain weights
_ONEDNN = torch.backends.mkldnn.is_available()
_POINTWISE = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if _ONEDNN else None
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if _ONEDNN else None
# off until a replica asks (`--cpu-onednn`): oneDNN's memory grows with every new batch shape
_ENABLED = [False]
# id(plain weight) -> its packed copy; an entry leaves with its weight (weakref.finalize)
_PACKS: dict[int, torch.Tensor] = {}
_THREAD = threading.local()


def _own_thread_count() -> None:
    """oneDNN sizes its OpenMP team from the calling thread's own OpenMP setting, which a thread
    started after `torch.set_num_threads` (the engine thread) does not inherit: it would run on as
    many threads as the machine has cores. Set it once per thread to torch's count."""
    if not getattr(_THREAD, "ready", False):
        torch.set_num_threads(torch.get_num_threads())
        _THREAD.ready = True


def use_onednn(on: bool) -> None:
    """Route float32 CPU linears through oneDNN (`--cpu-onednn`) or through `F.linear` (the default)."""
    _ENABLED[0] = on


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, as `F.linear`."""
    if _ENABLED[0] and _POINTWISE is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        _own_thread_count()
        packed = _PACKS.get(id(weight))
        return _POINTWISE(x, weight if packed is None else packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def packable(weight: torch.Tensor) -> bool:
    """Whether `pack` makes a copy of this weight (a 2-D float32 CPU matrix, oneDNN present)."""
    return (
        _REORDER is not None
        and _POINTWISE is not None
        and weight.dtype == torch.float32
        and (weight.device.type == "cpu" and weight.dim() == 2)
    )


def pack(weights: Iterable[torch.Tensor], rows: int = 32) -> int:
    """Packed copies of the packable `weights` (tuned for `rows`-row inputs; any row count works);
    returns the bytes they take."""
    total = 0
    _own_thread_count()
    for weight in weights:
        if not packable(weight) or id(weight) in _PACKS:
            continue
        _PACKS[id(weight)] = _REORDER(weight.detach(), rows)  # type: ignore[misc]
        weakref.finalize(weight, _PACKS.pop, id(weight), None)
        total += weight.numel() * weight.element_size()
    return total


def unpack(weights: Iterable[torch.Tensor]) -> None:
    """Drop the packed copies of `weights`: the next calls read the plain bytes again."""
    for weight in weights:
        _PACKS.pop(id(weight), None)


def is_packed(weight: torch.Tensor) -> bool:
    """Whether calls on `weight` use a packed copy."""
    return id(weight) in _PACKS
