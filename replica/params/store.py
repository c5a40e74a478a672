"""`ParamStore`: this replica's flat weight buffer, its readiness, and filling it from disk or host memory.

```
 LoadParams(DISK) ─► resolve path under --model-root ─► load_weights(buffer, on_region) ─► readiness.mark
 LoadParams(HOST) ─► host copy ──copy region by region──► buffer ───────────────────────► readiness.mark
 transfers (params/transfer.py) write the same buffer and mark the same readiness
```

The model's parameters are views into `buffer` (`build_model` over it), so bytes landing here ARE
the model: nothing is copied into the model afterwards.

Host-memory copy (what LOAD_FROM_HOST_MEM reads): taken when ResetStatus unloads a complete buffer
(like a GPU replica that keeps evicted weights in host DRAM, ServerlessLLM-style), kept for the
process's life (refreshed by the next unload of a complete buffer). Before any such unload there is
none and LOAD_FROM_HOST_MEM is FAILED_PRECONDITION, unless `warm_host_copy` filled it from the
checkpoint at start (`--host-cache`: the node keeps the checkpoint in host memory, the host-cache
baseline of scaling experiments). Loading never copies, so it stays as fast as a raw read of the
checkpoint.

Emulated bandwidths (`--disk-gbps`, `--host-gbps`, Gbit/s; 0 = as fast as this machine goes): each
region (disk) or chunk (host) is marked ready no earlier than the emulated device would have
delivered it, so a scale-up from disk or host memory costs here what it costs on the emulated
cluster, and readiness rises layer by layer at that pace (what live prefill sees).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from replica.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from replica.model.config import ModelConfig
from replica.model.layout import Region, WeightLayout
from replica.model.weights import load_weights
from replica.params.readiness import ParamReadiness
from transfer.core import Deadline
from transfer.tcp.ratelimit import LinkPacer

log = logging.getLogger(__name__)

_HOST_COPY_CHUNK = 64 << 20  # bytes per copy step (progress and readiness advance between steps)


class ParamStore:
    """The weight buffer (uint8, `layout.total_bytes`), its layout and readiness."""

    def __init__(
        self, layout: WeightLayout, buffer: torch.Tensor, readiness: ParamReadiness, model_root: Path,
        disk_gbps: float = 0.0, host_gbps: float = 0.0,
    ) -> None:
        self.layout = layout
        self.buffer = buffer
        self.readiness = readiness
        self.model_root = Path(model_root)
        self.host_copy: torch.Tensor | None = None
        self.disk_gbps = disk_gbps
        self.host_gbps = host_gbps

    # ------------------------------------------------------------------------ region facts
    def regions(self) -> list[tuple[int, int]]:
        """(offset, length) of every region in layout order: what transfers move."""
        return self.layout.segments()

    def mark_region(self, index: int) -> None:
        """Region `index` (layout order) landed completely."""
        region = self.layout.regions[index]
        self.readiness.mark(region.kind, region.index)

    def begin_fill(self, what: str) -> None:
        """Before bytes are written: refuse on a complete buffer, else start readiness from zero."""
        if self.readiness.complete:
            raise FailedPrecondition(f"{what}: the weights are already loaded (ResetStatus first)")
        self.readiness.reset()

    def require_complete(self, what: str) -> None:
        """A sender must hold every region."""
        self.readiness.require_complete(what)

    # ---------------------------------------------------------------------------- loading
    def resolve(self, model_name: str, model_path: str | None) -> Path:
        """The checkpoint folder a LoadParams names, confined to the model root (symlinks resolved).

        `model_path` (absolute, or relative to the root) wins; else `model_name` is a folder under
        the root. Outside the root → PERMISSION_DENIED; no checkpoint there → NOT_FOUND.
        """
        root = self.model_root.resolve()
        name = model_path or model_name
        if not name:
            raise InvalidArgument("LOAD_FROM_DISK needs model_path or model_name")
        raw = Path(name)
        target = (raw if raw.is_absolute() else root / raw).resolve()
        if target != root and root not in target.parents:
            raise PermissionDenied(f"{model_path} is outside the model root {root}")
        if not (target / "config.json").is_file():
            raise NotFound(f"no checkpoint (config.json) at {target}")
        return target

    def load_from_disk(self, path: Path) -> None:
        """Fill the buffer from the checkpoint at `path` (already resolved)."""
        self._check_layout(path)
        self.begin_fill("LoadParams from disk")
        start = time.perf_counter()
        pace = _pacer(self.disk_gbps)
        with _progress(self.layout, f"loading {path.name}") as advance:

            def landed(name: str) -> None:
                region = self.layout.region(name)
                pace(region.nbytes)
                self.readiness.mark(region.kind, region.index)
                advance(region)

            load_weights(path, self.layout, self.buffer, landed)
        _log_speed("loaded from disk", self.layout.total_bytes, start)

    def load_from_host(self) -> None:
        """Fill the buffer from the host-memory copy, region by region."""
        copy = self.host_copy
        if copy is None:
            raise FailedPrecondition(
                "no host-memory copy of the weights (ResetStatus of a loaded replica keeps one)"
            )
        self.begin_fill("LoadParams from host memory")
        start = time.perf_counter()
        pace = _pacer(self.host_gbps)
        with _progress(self.layout, "loading from host memory") as advance:
            for region in self.layout.regions:
                for lo in range(region.offset, region.end, _HOST_COPY_CHUNK):
                    hi = min(lo + _HOST_COPY_CHUNK, region.end)
                    self.buffer[lo:hi].copy_(copy[lo:hi])
                    pace(hi - lo)
                self.readiness.mark(region.kind, region.index)
                advance(region)
        _log_speed("loaded from host memory", self.layout.total_bytes, start)

    def warm_host_copy(self, path: Path) -> None:
        """Read the checkpoint at `path` into the host-memory copy (not into the buffer, not paced)."""
        self._check_layout(path)
        copy = torch.empty_like(self.buffer)
        load_weights(path, self.layout, copy, lambda _name: None)
        self.host_copy = copy
        log.info("host cache: %.1f MB of %s kept in host memory", copy.numel() / 1e6, path.name)

    def unload(self) -> None:
        """ResetStatus: keep the bytes as the host copy when complete, then mark nothing loaded."""
        if self.readiness.complete:
            if self.host_copy is None:
                self.host_copy = torch.empty_like(self.buffer)
            self.host_copy.copy_(self.buffer)
        self.readiness.reset()

    def _check_layout(self, path: Path) -> None:
        other = WeightLayout.for_config(ModelConfig.from_dir(path), self.layout.dtype, self.layout.shard)
        if other.signature() != self.layout.signature():
            raise FailedPrecondition(f"the checkpoint at {path} has a different weight layout")


class _Progress:
    """A tqdm bar (stderr) over the buffer's bytes, advanced region by region."""

    def __init__(self, layout: WeightLayout, desc: str) -> None:
        self.bar = tqdm(total=layout.total_bytes, unit="B", unit_scale=True, desc=desc, leave=False)

    def __enter__(self) -> Callable[[Region], None]:
        return lambda region: self.bar.update(region.nbytes)

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def _progress(layout: WeightLayout, desc: str) -> _Progress:
    return _Progress(layout, desc)


def _pacer(gbps: float) -> Callable[[int], None]:
    """`pace(nbytes)` blocks until an emulated device of `gbps` would have delivered them (0: never)."""
    if gbps <= 0:
        return lambda _nbytes: None
    pacer, never = LinkPacer(gbps), Deadline(float("inf"))
    return lambda nbytes: pacer.take(nbytes, never)


def _log_speed(what: str, nbytes: int, start: float) -> None:
    seconds = max(time.perf_counter() - start, 1e-9)
    log.info("weights %s: %.1f MB in %.3f s (%.2f GB/s)", what, nbytes / 1e6, seconds, nbytes / seconds / 1e9)
