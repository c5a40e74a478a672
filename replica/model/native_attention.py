"""CPU decode attention by a small C++ kernel built at start (`--attention-backend native`).

`native_kernel.SOURCE` is compiled once per model shape (page size, KV heads, group, head size
are constants in it) with the C++ compiler inductor would use ($CXX, else g++), into a shared
library loaded with ctypes: no torch headers, no dynamo, ~0.5 s to build, nothing on later starts
(the library is kept under the temporary directory, named by a hash of the source, the flags, the
shape, the compiler and this CPU's feature flags: `-march=native` code never runs on another CPU).

One call per layer attends a decode group: it writes the new tokens' K and V rows into their
slots (when given them) and reads every visible key and value once, in place, from its page. A
call costs a few microseconds of Python (ctypes) against ~100 for a torch.compile'd function's
guards and wrappers. float32 on the CPU only. With several torch threads a call's sequences are
split between the engine thread and a small pool (ctypes releases the GIL), at least 4 each.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from replica.model.compiled_attention import compiler_missing
from replica.model.kv_pages import PagedKVCache
from replica.model.native_kernel import SOURCE

log = logging.getLogger(__name__)

__all__ = ["NativeBuildError", "Shape", "build", "compiler_missing", "decode", "kernel_for", "warm"]

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
_BUILD_S = 120.0  # a compiler that does not answer within this is a build failure
_SEQS_PER_THREAD = 4  # fewer sequences than this per thread: not worth a split


class NativeBuildError(RuntimeError):
    """The kernel could not be built or loaded here (the replica keeps the torch path)."""


class Shape(NamedTuple):
    """What the kernel is compiled for."""

    block_size: int
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int

    @classmethod
    def of(cls, cache: PagedKVCache, group: int) -> Shape:
        return cls(cache.block_size, cache.num_kv_heads, group, cache.head_dim)

    def defines(self) -> list[str]:
        return [f"-DBS={self.block_size}", f"-DKVH={self.kv_heads}", f"-DGROUP={self.group}",
                f"-DHD={self.head_dim}"]


def _cpu_flags() -> str:
    """This CPU's feature flags (the build is `-march=native`); empty where /proc is not there."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _library_path(shape: Shape, compiler: str) -> Path:
    key = "\n".join([SOURCE, *FLAGS, *shape.defines(), compiler, _cpu_flags()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return Path(tempfile.gettempdir()) / f"pdcluster-kernels-{os.getuid()}" / f"paged_decode-{digest}.so"


def _compile(shape: Shape, compiler: str, target: Path) -> None:
    """Build into a private file, then rename: concurrent builders never see a partial library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    source = target.with_suffix(f".{os.getpid()}.cpp")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    source.write_text(SOURCE)
    try:
        command = [compiler, *FLAGS, *shape.defines(), str(source), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_S, check=False)
        if done.returncode != 0:
            raise NativeBuildError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"{compiler}: {e}") from e
    finally:
        source.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)


@functools.cache
def build(shape: Shape) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The kernel for `shape`, built now unless a library of the same key exists; raises
    `NativeBuildError` (no compiler, a compile error, a library that does not load)."""
    reason = compiler_missing()
    if reason is not None:
        raise NativeBuildError(reason)
    compiler = os.environ.get("CXX") or "g++"
    path = _library_path(shape, compiler)
    if not path.exists():
        _compile(shape, compiler, path)
    try:
        function = ctypes.CDLL(str(path)).paged_decode
    except (OSError, AttributeError) as e:
        raise NativeBuildError(f"cannot load {path}: {e}") from e
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, size, pointer, size, pointer, size, pointer, pointer, pointer, size,
                         pointer, size, pointer, size]
    function.restype = None
    return function


def kernel_for(layer_pages: torch.Tensor, heads: int, head_dim: int
               ) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The kernel for `heads` query heads of `head_dim` over these pages (one layer of a cache: a
    tensor-parallel rank's own heads), or None where it does not apply (not float32 on the CPU) or
    cannot be built (said once per shape: e.g. after a model switch to another shape); ValueError
    when the heads do not fit the pages."""
    _, _, block_size, kv_heads, pages_head_dim = layer_pages.shape
    if heads % kv_heads or head_dim != pages_head_dim:
        raise ValueError(f"{heads} query heads of {head_dim} do not fit pages of {kv_heads} KV heads "
                         f"of {pages_head_dim}")
    if layer_pages.dtype != torch.float32 or layer_pages.device.type != "cpu":
        return None
    return _built_or_none(Shape(block_size, kv_heads, heads // kv_heads, head_dim))


@functools.cache
def _built_or_none(shape: Shape) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        return build(shape)
    except NativeBuildError as e:
        log.warning("decode attention keeps the torch path for %s: %s", shape, e)
        return None


def warm(cache: PagedKVCache, group: int) -> float:
    """Build (or find) the kernel for `cache`'s model now; returns the seconds it took."""
    started = time.perf_counter()
    build(Shape.of(cache, group))
    return time.perf_counter() - started


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` as rows of `width` contiguous floats (a copy only if its rows are not)."""
    flat = t.reshape(t.shape[0], width)
    return flat if flat.stride(1) == 1 else flat.contiguous()


def decode(
    layer_pages: torch.Tensor,
    q: torch.Tensor,
    table: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """One new token per sequence attends over its pages: (seqs, heads * head_dim).

    q: (seqs, heads, head_dim) (rows may be strided); layer_pages: one layer of the cache;
    table: (seqs, pages) page ids, every one valid (padding included: the caller validated them);
    q_pos: (seqs,) positions; keys at (q_pos - window, q_pos] are visible. `new_kv` = (k, v, slots):
    (seqs, kv_heads * head_dim) each and their K rows in the layer, written first.
    With several torch threads the sequences are split between them (ctypes releases the GIL).
    The kernel is the one built for the shape these tensors have (a rank of a tensor-parallel group
    has its own heads); None where there is none (not float32 on the CPU, or it cannot be built):
    nothing was written then, the caller takes the torch path.
    """
    seqs, heads, head_dim = q.shape
    kernel = kernel_for(layer_pages, heads, head_dim)
    if kernel is None:
        return None
    q = _rows(q, heads * head_dim)
    table, q_pos = table.contiguous(), q_pos.contiguous()
    out = q.new_empty((seqs, heads * head_dim))
    pieces = min(torch.get_num_threads(), seqs // _SEQS_PER_THREAD)
    k = v = slots = None
    if new_kv is not None:
        width = layer_pages.shape[3] * layer_pages.shape[4]
        k, v, slots = _rows(new_kv[0], width), _rows(new_kv[1], width), new_kv[2].contiguous()
        if pieces > 1:  # every new row is written before any piece reads (as one call does)
            rows = layer_pages.view(-1, width)
            rows.index_copy_(0, slots, k)
            rows.index_copy_(0, slots + layer_pages.shape[2], v)
            k = v = slots = None
    # each argument's address of sequence 0 and its bytes per sequence (None: not passed)
    starts = [(t.data_ptr(), t.stride(0) * t.element_size()) if t is not None else None
              for t in (q, k, v, slots, table, q_pos, out)]
    strides = [0 if t is None else t.stride(0) for t in (q, k, v)]

    def run(first: int, stop: int) -> None:
        at = [None if r is None else r[0] + first * r[1] for r in starts]
        kernel(at[0], strides[0], at[1], strides[1], at[2], strides[2], at[3], layer_pages.data_ptr(),
               at[4], table.shape[1], at[5], window or 0, at[6], stop - first)

    if pieces <= 1:
        run(0, seqs)
        return out
    bounds = [seqs * i // pieces for i in range(pieces + 1)]
    others = [_pool(pieces - 1).submit(run, a, b) for a, b in itertools.pairwise(bounds[1:])]
    run(bounds[0], bounds[1])
    for done in others:
        done.result()
    return out


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """Threads for the other pieces of a split call (made by the engine thread: its CPU placement)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="native-attention")
