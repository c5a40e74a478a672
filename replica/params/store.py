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
baseline of scaling experiments). Copies are kept by model name in a `HostCache` of at most
`--host-cache-bytes` (0 = unlimited), least recently used evicted first: a model larger than it is
never kept, and LOAD_FROM_HOST_MEM of a model not held is a miss (FAILED_PRECONDITION). Loading
never copies, so it stays as fast as a raw read of the checkpoint.

The bytes themselves come through a `WeightIO`: a Hugging Face checkpoint read into a torch tensor
(`checkpoint.CheckpointIO`, the default), or a simulated GPU's weight buffer of a model card's
sizes, scaled (`replica/engine/sim/weights.py`); this module imports no torch.

Emulated bandwidths (`--disk-gbps`, `--host-gbps`, Gbit/s; 0 = as fast as this machine goes): each
region (disk) or chunk (host) is marked ready no earlier than the emulated device would have
delivered it, so a scale-up from disk or host memory costs here what it costs on the emulated
cluster, and readiness rises layer by layer at that pace (what live prefill sees).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from replica.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ReplicaError
from replica.model.layout import Region, WeightLayout
from replica.params.host_cache import HostCache
from replica.params.readiness import ParamReadiness
from transfer.core import Deadline
from transfer.tcp.ratelimit import LinkPacer

log = logging.getLogger(__name__)

_HOST_COPY_CHUNK = 64 << 20  # bytes per copy step (progress and readiness advance between steps)


class WeightIO(Protocol):
    """Where the weight bytes come from and how the buffer is copied (torch tensors, or plain bytes)."""

    def has_checkpoint(self, path: Path) -> bool:
        """Something to load is at `path`."""
        ...

    def check_layout(self, path: Path, layout: WeightLayout) -> None:
        """FAILED_PRECONDITION unless what is at `path` lays out exactly like `layout`."""
        ...

    def load(self, path: Path, layout: WeightLayout, buffer: Any, landed: Callable[[str], None]) -> None:
        """Fill `buffer` from `path`, calling `landed(region name)` in layout order as each completes."""
        ...

    def empty_copy(self, buffer: Any) -> Any:
        """A host buffer the size of `buffer`."""
        ...

    def copy(self, dst: Any, src: Any, lo: int, hi: int) -> None:
        """Bytes [lo, hi) of `src` into `dst`."""
        ...

    def sendable(self, copy: Any, buffer: Any) -> Any:
        """The bytes a fabric registers to send the host copy `copy` of a model laid out as `buffer`."""
        ...


class ParamStore:
    """The weight buffer (`layout.total_bytes` bytes), its layout and readiness."""

    def __init__(
        self, layout: WeightLayout, buffer: Any, readiness: ParamReadiness, model_root: Path,
        disk_gbps: float = 0.0, host_gbps: float = 0.0, io: WeightIO | None = None,
        host_cache_bytes: int = 0, model_name: str = "",
    ) -> None:
        self.layout = layout
        self.buffer = buffer  # the model's bytes: `layout.total_bytes` at the start of `room`
        self.room = buffer  # the whole buffer (what the fabric registers): larger with --weight-buffer-bytes
        self.readiness = readiness
        self.model_root = Path(model_root)
        self.host_cache = HostCache(host_cache_bytes)  # the node's copies by model name (LRU)
        self._copy_layouts: dict[str, WeightLayout] = {}  # how each host copy is laid out (sending one)
        self.model_name = model_name  # what the buffer holds, or last held (the host copy's key)
        self.disk_gbps = disk_gbps
        self.host_gbps = host_gbps
        self.io = io if io is not None else _checkpoint_io()
        # lays the buffer (and the engine) out for the checkpoint at a path, or FAILED_PRECONDITION
        # (`replica/engine/switch.py`); None: one layout for life (a different one is refused)
        self.relayout: Callable[[Path], None] | None = None

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

    def begin_receive(self, what: str, model_name: str) -> None:
        """`begin_fill` for a transfer into this buffer, which from now on holds `model_name` (the
        name the transfer's call gave; "" = unknown, so ResetStatus keeps no host copy under a guess).
        A named model of another shape whose checkpoint is under the model root is laid out first."""
        path = self._checkpoint_of(model_name) if self.relayout is not None else None
        if path is not None:
            self.lay_out_for(path, what)
        self.begin_fill(what)
        self.model_name = model_name

    def lay_out_for(self, path: Path, what: str) -> None:
        """Before filling the buffer with the checkpoint at `path`: nothing when it lays out like the
        buffer; else the buffer is laid out for it (`relayout`), refused (FAILED_PRECONDITION) while
        the weights are complete, or by the switch (too big, batches cached), or without one."""
        try:
            self.io.check_layout(path, self.layout)
            return
        except FailedPrecondition:
            if self.relayout is None:
                raise
        if self.readiness.complete:
            raise FailedPrecondition(f"{what}: the weights are already loaded (ResetStatus first)")
        self.relayout(path)

    def _checkpoint_of(self, model_name: str) -> Path | None:
        """The checkpoint folder named `model_name` under the model root, or None (none there)."""
        if not model_name:
            return None
        try:
            return self.resolve(model_name, None)
        except (NotFound, PermissionDenied):
            return None

    def require_model(self, what: str, model_name: str) -> None:
        """A sender asked for `model_name` must hold it (FAILED_PRECONDITION otherwise; "" on
        either side: nothing to check)."""
        if model_name and self.model_name and model_name != self.model_name:
            raise FailedPrecondition(f"{what}: asked to send model {model_name!r}, but this replica's "
                                     f"weights are {self.model_name!r}")

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
        if not self.io.has_checkpoint(target):
            raise NotFound(f"no checkpoint (config.json) at {target}")
        return target

    def load_from_disk(self, path: Path, name: str = "") -> None:
        """Fill the buffer from the checkpoint at `path` (already resolved; laid out for it first),
        which holds model `name` from now on (default: the folder's name; the caller's name is kept
        as given, so a symlinked folder keeps the name callers know it by)."""
        self.lay_out_for(path, "LoadParams from disk")
        self.begin_fill("LoadParams from disk")
        self.model_name = name or path.name
        start = time.perf_counter()
        pace = _pacer(self.disk_gbps)
        with _progress(self.layout, f"loading {path.name}") as advance:

            def landed(name: str) -> None:
                region = self.layout.region(name)
                pace(region.nbytes)
                self.readiness.mark(region.kind, region.index)
                advance(region)

            self.io.load(path, self.layout, self.buffer, landed)
        _log_speed("loaded from disk", self.layout.total_bytes, start)

    @property
    def host_copy(self) -> Any:
        """The host-memory copy of this replica's model, or None."""
        return self.host_cache.peek(self.model_name)

    def host_copies(self) -> list[tuple[str, int]]:
        """(model, bytes) of every host-memory copy held, least recently used first (Info)."""
        return [(name, self.host_cache.nbytes(name)) for name in self.host_cache.names()]

    def host_copy_to_send(self, model_name: str) -> Any:
        """The host copy of `model_name` for a peer (SendParams.host_copy_model): NOT_FOUND when none
        is held; FAILED_PRECONDITION when it is laid out otherwise than the buffer now (the PARAMS
        stream's handshake announces the buffer's layout, and the regions sent are its)."""
        copy = self.host_cache.peek(model_name) if model_name else None
        if copy is None:
            raise NotFound(f"no host-memory copy of {model_name or '(no model named)'} to send (held: "
                           f"{self.host_cache.names()})")
        layout = self._copy_layouts.get(model_name, self.layout)
        if layout.signature() != self.layout.signature():
            raise FailedPrecondition(f"the host copy of {model_name} is laid out for another shape than "
                                     "this replica's weight buffer now; it cannot be sent from here")
        return self.io.sendable(copy, self.buffer)

    def _keep_host_copy(self, copy: Any, name: str = "") -> None:
        """Keep `copy` (laid out as the buffer now) as the host copy of `name` (default:
        `model_name`), when it fits."""
        name = name or self.model_name
        if self.host_cache.put(name, copy, self.layout.total_bytes):
            self._copy_layouts[name] = self.layout
        held = set(self.host_cache.names())
        self._copy_layouts = {k: v for k, v in self._copy_layouts.items() if k in held}

    def load_from_host(self, model_name: str = "") -> None:
        """Fill the buffer from the host-memory copy of `model_name` (default: this replica's model),
        region by region; FAILED_PRECONDITION on a miss (never cached, evicted, or too big)."""
        name = model_name or self.model_name
        copy = self.host_cache.get(name)
        if copy is None:
            raise FailedPrecondition(
                f"host cache miss: no host-memory copy of {name or 'the weights'} (held: "
                f"{self.host_cache.names()}; ResetStatus of a loaded replica keeps one when it fits "
                f"--host-cache-bytes)"
            )
        path = self._checkpoint_of(name) if self.relayout is not None else None
        if path is not None:
            self.lay_out_for(path, "LoadParams from host memory")
        self.model_name = name
        self.begin_fill("LoadParams from host memory")
        start = time.perf_counter()
        pace = _pacer(self.host_gbps)
        with _progress(self.layout, "loading from host memory") as advance:
            for region in self.layout.regions:
                for lo in range(region.offset, region.end, _HOST_COPY_CHUNK):
                    hi = min(lo + _HOST_COPY_CHUNK, region.end)
                    self.io.copy(self.buffer, copy, lo, hi)
                    pace(hi - lo)
                self.readiness.mark(region.kind, region.index)
                advance(region)
        _log_speed("loaded from host memory", self.layout.total_bytes, start)

    def warm_host_copy(self, path: Path, name: str = "") -> None:
        """Read the checkpoint at `path` into a host-memory copy (not into the buffer, not paced),
        named `name` (default: this replica's model, else the folder's name)."""
        self.io.check_layout(path, self.layout)
        if not name:
            self.model_name = name = self.model_name or path.name
        if not self.host_cache.fits(self.layout.total_bytes):
            log.info("host cache: %s (%.1f MB) does not fit --host-cache-bytes %d", path.name,
                     self.layout.total_bytes / 1e6, self.host_cache.capacity)
            return
        copy = self.io.empty_copy(self.buffer)
        self.io.load(path, self.layout, copy, lambda _name: None)
        self._keep_host_copy(copy, name)
        log.info("host cache: %.1f MB of %s kept in host memory", self.layout.total_bytes / 1e6, name)

    def warm_host_models(self, names: Sequence[str]) -> None:
        """`--host-models`: a host copy of each checkpoint folder named (under the model root), in
        order, within `--host-cache-bytes` (least recently used evicted); ValueError naming the
        flag for one that is not there or lays out otherwise than the weight buffer."""
        for name in names:
            try:
                self.warm_host_copy(self.resolve(name, None), name)
            except ReplicaError as exc:
                raise ValueError(f"--host-models {name}: {exc}") from None

    def unload(self) -> None:
        """ResetStatus: keep the bytes as the host copy of `model_name` (when complete, named, and it
        fits the host cache, evicting least recently used copies), then mark nothing loaded."""
        nbytes = self.layout.total_bytes
        if self.readiness.complete and self.model_name and self.host_cache.fits(nbytes):
            copy = self.host_cache.peek(self.model_name)
            copy = copy if copy is not None else self.io.empty_copy(self.buffer)
            self.io.copy(copy, self.buffer, 0, nbytes)
            self._keep_host_copy(copy)
        self.readiness.reset()


def _checkpoint_io() -> WeightIO:
    """The torch engine's `WeightIO` (imported here: this module itself stays free of torch)."""
    from replica.params.checkpoint import CheckpointIO

    return CheckpointIO()


class _Progress:
    """A tqdm bar (stderr) over the buffer's bytes, advanced region by region."""

    def __init__(self, layout: WeightLayout, desc: str) -> None:
        from tqdm import tqdm  # only when loading: its import costs a replica's start-up a tenth of a second

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
