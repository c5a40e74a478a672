"""The flat weight buffer: allocate it, view it as typed tensors, fill it from safetensors files.

```
 model.safetensors (or model-0000i-of-0000N.safetensors + model.safetensors.index.json)
        │ headers parsed here; bytes read with positional reads (16 MiB chunks, two threads)
        ▼ straight into the buffer when dtypes match
 buffer (uint8, layout.total_bytes): | embed | layer 0 | … | layer L-1 | head |
        ▲  on_region("embed"), on_region("layer.0"), …, on_region("head") as each region completes
```

Reading the file's bytes directly into the buffer (no mmap, no intermediate tensor) keeps loading
as fast as a raw read of the same files; only a dtype cast or a tensor-parallel slice goes through a
temporary tensor. A device buffer (CUDA) is filled through each reader thread's pinned host buffer:
read into it, one asynchronous copy to the device, wait for that copy, reuse; the two threads
overlap one's read with the other's copy, and a region is complete on the device when reported.
A truncated file, a missing tensor, a wrong shape or an unknown extra tensor is a `CheckpointError`
naming it.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.model.config import CheckpointError
from replica.model.layout import LM_HEAD_NAME, Split, TensorSpec, WeightLayout

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors some checkpoints carry that the math recomputes or does not need.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)

RegionCallback = Callable[[str], None]


def dtype_name(dtype: torch.dtype) -> str:
    """The layout's name for a torch dtype (refuses the ones we do not serve)."""
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} not supported (supported: {', '.join(TORCH_DTYPES)})")
    return DTYPE_NAMES[dtype]


def allocate_buffer(layout: WeightLayout, device: str = "cpu") -> torch.Tensor:
    """An uninitialised uint8 buffer of the layout's size."""
    return torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)


def tensor_view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The typed view of `spec` inside the flat `buffer` (shares memory)."""
    return buffer[spec.offset : spec.end].view(TORCH_DTYPES[spec.dtype]).view(spec.shape)


def tensor_views(layout: WeightLayout, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every tensor of the layout as a view, by HF name (a tied lm_head maps to the embedding)."""
    if buffer.dtype != torch.uint8 or buffer.numel() != layout.total_bytes:
        raise ValueError(
            f"buffer must be uint8 of {layout.total_bytes} bytes, got {buffer.dtype} {buffer.numel()}"
        )
    views = {name: tensor_view(buffer, spec) for name, spec in layout.tensors().items()}
    views[LM_HEAD_NAME] = tensor_view(buffer, layout.lm_head)
    return views


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes are in a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Parse one safetensors file's header (8-byte little-endian length + JSON)."""
    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read safetensors header of {file}: {exc}") from exc
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        tensors[name] = StoredTensor(
            file, _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, base + end
        )
    return tensors


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (from the index when sharded)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"cannot read {index}: {exc}") from exc
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: safetensors file(s) named by the index are missing: {missing}")
    return files


def stored_tensors(path: Path) -> tuple[dict[str, StoredTensor], list[Path]]:
    """All tensors of the checkpoint by name, and the files searched."""
    files = checkpoint_files(path)
    found: dict[str, StoredTensor] = {}
    for file in files:
        found.update(read_header(file))
    return found, files


def _check_extras(layout: WeightLayout, stored: dict[str, StoredTensor]) -> None:
    expected = set(layout.tensors())
    harmless = {LM_HEAD_NAME} if layout.tied_embeddings else set()
    extra = sorted(
        n for n in stored if n not in expected and n not in harmless and not n.endswith(_HARMLESS_SUFFIXES)
    )
    if extra:
        shown = ", ".join(extra[:5]) + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
        raise CheckpointError(f"checkpoint has tensors this model does not use: {shown}")


def _shard_slice(full: torch.Tensor, spec: TensorSpec, layout: WeightLayout) -> torch.Tensor:
    if spec.split is Split.REPLICATED or layout.shard.world == 1:
        return full
    dim = 0 if spec.split is Split.ROWS else 1
    size, world = spec.shape[dim], layout.shard.world
    part = layout.shard.rank * (spec.parts or world) // world  # replicated KV heads: ranks share a part
    return full.narrow(dim, part * size, size)


def _full_shape(spec: TensorSpec, layout: WeightLayout) -> tuple[int, ...]:
    shape, parts = list(spec.shape), spec.parts or layout.shard.world
    if spec.split is Split.ROWS:
        shape[0] *= parts
    elif spec.split is Split.COLUMNS:
        shape[1] *= parts
    return tuple(shape)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU uint8 tensor."""
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]


# Big tensors are read in chunks so the reader threads share the work evenly.
CHUNK_BYTES = 16 << 20
READ_THREADS = 2


def _pread_into(fd: int, file: Path, target: memoryview, offset: int) -> None:
    """Fill `target` with the file's bytes from `offset` (positional reads: threads share the fd)."""
    done = 0
    while done < len(target):
        got = os.preadv(fd, [target[done:]], offset + done)
        if not got:
            raise CheckpointError(f"{file}: truncated while reading tensor data")
        done += got


class _Reader:
    """Reads stored tensors into buffer views; one descriptor per file, shared by the reader threads."""

    def __init__(self, stack: ExitStack, layout: WeightLayout, buffer: torch.Tensor) -> None:
        self.layout, self.buffer = layout, buffer
        self.fds: dict[Path, int] = {}
        stack.callback(self._close)

    def _close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)

    def fd(self, file: Path) -> int:
        if file not in self.fds:
            self.fds[file] = os.open(file, os.O_RDONLY)
        return self.fds[file]

    def tasks(self, spec: TensorSpec, stored: StoredTensor) -> list[Callable[[], None]]:
        """Work items that together load `spec` (several chunks when it is read without a cast)."""
        if stored.shape != _full_shape(spec, self.layout):
            raise CheckpointError(
                f"tensor {spec.name}: shape {list(stored.shape)} in {stored.file.name}, "
                f"config expects {list(_full_shape(spec, self.layout))}"
            )
        fd = self.fd(stored.file)
        direct = stored.dtype == TORCH_DTYPES[spec.dtype] and self.layout.shard.world == 1
        if not direct:
            return [functools.partial(self._load_converted, spec, stored, fd)]
        size = spec.end - spec.offset
        if self.buffer.device.type != "cpu":  # through pinned host memory, chunk by chunk
            return [
                functools.partial(self._load_staged, fd, stored.file, spec.offset + i, stored.begin + i,
                                  min(CHUNK_BYTES, size - i))
                for i in range(0, size, CHUNK_BYTES)
            ]
        target = _bytes_of(self.buffer[spec.offset : spec.end])  # straight into the buffer: no copy
        return [
            functools.partial(_pread_into, fd, stored.file, target[i : i + CHUNK_BYTES], stored.begin + i)
            for i in range(0, len(target), CHUNK_BYTES)
        ]

    def _load_staged(self, fd: int, file: Path, offset: int, begin: int, size: int) -> None:
        """Bytes [begin, begin+size) of `file` into the device buffer at `offset` via pinned memory."""
        staging = _staging(size)
        _pread_into(fd, file, _bytes_of(staging), begin)
        _device_copy(self.buffer[offset : offset + size], staging)

    def _load_converted(self, spec: TensorSpec, stored: StoredTensor, fd: int) -> None:
        size = stored.end - stored.begin
        on_device = self.buffer.device.type != "cpu"
        raw = _staging(size) if on_device else torch.empty(size, dtype=torch.uint8)
        _pread_into(fd, stored.file, _bytes_of(raw), stored.begin)
        full = raw.view(stored.dtype).view(stored.shape)
        part = _shard_slice(full, spec, self.layout)
        if on_device:
            _device_copy(tensor_view(self.buffer, spec), part)
        else:
            tensor_view(self.buffer, spec).copy_(part)


_STAGING = threading.local()


def _staging(size: int) -> torch.Tensor:
    """This reader thread's pinned host buffer of `size` bytes (grown as needed, reused after)."""
    held: torch.Tensor | None = getattr(_STAGING, "buffer", None)
    if held is None or held.numel() < size:
        held = torch.empty(max(size, CHUNK_BYTES), dtype=torch.uint8, pin_memory=True)
        _STAGING.buffer = held
    return held[:size]


def _device_copy(target: torch.Tensor, staged: torch.Tensor) -> None:
    """Copy pinned `staged` into device `target` (casting if the dtypes differ) and wait for it, so
    the staging buffer can be reused and the region is complete when its task is."""
    target.copy_(staged, non_blocking=True)  # on the target device's current stream
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(target.device))  # a reader thread's own current device may differ
    done.synchronize()


def _in_file_order(specs: tuple[TensorSpec, ...], stored: dict[str, StoredTensor]) -> Iterator[TensorSpec]:
    # Within a region, read in file order so the disk sees forward reads.
    return iter(sorted(specs, key=lambda s: (str(stored[s.name].file), stored[s.name].begin)))


def load_weights(
    path: Path, layout: WeightLayout, buffer: torch.Tensor, on_region: RegionCallback | None = None
) -> None:
    """Fill `buffer` from the checkpoint at `path`, calling `on_region(name)` as each region completes.

    Reads run on a few threads (page faults and copies overlap); regions are reported in layout
    order, from the calling thread, as soon as each one and all before it are complete.
    """
    stored, files = stored_tensors(Path(path))
    missing = [name for name in layout.tensors() if name not in stored]
    if missing:
        raise CheckpointError(
            f"tensor {missing[0]} not found in {[f.name for f in files]} under {path}"
            + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else "")
        )
    _check_extras(layout, stored)
    with ExitStack() as stack:
        reader = _Reader(stack, layout, buffer)
        per_region = [
            [
                task
                for spec in _in_file_order(region.tensors, stored)
                for task in reader.tasks(spec, stored[spec.name])
            ]
            for region in layout.regions
        ]
        pool = stack.enter_context(ThreadPoolExecutor(READ_THREADS, thread_name_prefix="weights"))
        futures = [[pool.submit(task) for task in tasks] for tasks in per_region]
        try:
            for region, region_futures in zip(layout.regions, futures, strict=True):
                for future in region_futures:
                    future.result()
                if on_region is not None:
                    on_region(region.name)
        finally:
            for region_futures in futures:
                for future in region_futures:
                    future.cancel()
