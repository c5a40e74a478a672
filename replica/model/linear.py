"""`linear(x, weight, bias)`: the model's matmuls, through oneDNN for float32 on the CPU (unless a
replica says `--no-cpu-onednn`, `use_onednn(False)`), else `F.linear`.

On by default for float32 on the CPU (`--no-cpu-onednn` turns it off). oneDNN keeps one primitive
per distinct problem shape (rows x weight shape) in its process-wide cache, ~0.6 MiB each however
small the matrices (its JIT-compiled kernels), and past the cache's 1,024 entries it evicts and
re-creates them, fragmenting the heap: a replica seeing every batch size from 1 to 2,048 grew by
65-185 MiB a minute. So the row count is bounded to a few shapes: an input is padded with zero rows
to its bucket (`bucket_rows`: multiples of 8 up to 64, then 4 steps per doubling up to `CHUNK`), and
longer inputs run as `CHUNK`-row pieces. That is ~20 row shapes per weight shape, all created by
`warm` before a replica serves, so its memory is flat from then on. Padded rows cost their compute
(fewer than 8 up to 64 rows, under a quarter more past 64; a decode step of 1-8 rows is
weight-bound anyway) and change no real row's result: rows of a matmul are independent.

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
# on unless a replica says `--no-cpu-onednn` (the factory sets it from the replica's config)
_ENABLED = [True]
# the most rows one oneDNN call sees: longer inputs run in pieces of this many rows
CHUNK = 512
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
    """Route float32 CPU linears through oneDNN (the default) or through `F.linear` (`--no-cpu-onednn`)."""
    _ENABLED[0] = on


def bucket_rows(rows: int) -> int:
    """The row count an input of `rows` (1..CHUNK) rows is padded to: a multiple of 8 up to 64,
    then of 1/8 of the next power of two (16 up to 128, 32 up to 256, 64 up to 512)."""
    step = 8 if rows <= 64 else (1 << (rows - 1).bit_length()) // 8
    return -(-rows // step) * step


def buckets() -> list[int]:
    """Every row count oneDNN is called with (`bucket_rows` of 1..CHUNK)."""
    return sorted({bucket_rows(rows) for rows in range(1, CHUNK + 1)})


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, as `F.linear`."""
    if _ENABLED[0] and _POINTWISE is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        if x.dim() != 2 or x.shape[0] == 0:  # the model passes (tokens, features); anything else as is
            return F.linear(x, weight, bias)
        _own_thread_count()
        packed = _PACKS.get(id(weight), weight)
        if x.shape[0] <= CHUNK:
            return _bucketed(x, packed, bias)
        return torch.cat([_bucketed(part, packed, bias) for part in x.split(CHUNK)])
    return F.linear(x, weight, bias)


def _bucketed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN on `x` padded with zero rows to its bucket; the real rows of the result."""
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:
        full = x.new_zeros((padded, x.shape[1]))
        full[:rows] = x
        x = full
    out = _POINTWISE(x, weight, bias, "none", [], "")  # type: ignore[misc]
    return out if padded == rows else out[:rows]


def warm(pairs: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> int:
    """Create oneDNN's primitive for every bucket and every distinct kind of (weight, bias) pair
    (weight shape, packed or not, with a bias or not) before serving, so that no new one appears
    later; returns how many calls that took. Does nothing while oneDNN is off."""
    if not _ENABLED[0] or _POINTWISE is None:
        return 0
    _own_thread_count()
    kinds: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
    for weight, bias in pairs:
        if packable(weight):
            kinds.setdefault((tuple(weight.shape), id(weight) in _PACKS, bias is None), (weight, bias))
    for weight, bias in kinds.values():
        for rows in buckets():
            linear(weight.new_zeros((rows, weight.shape[1])), weight, bias)
    return len(kinds) * len(buckets())


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
