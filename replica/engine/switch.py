"""`ModelSwitch`: laying a replica's weight buffer and KV pages out for another checkpoint.

```
 start: one flat buffer of max(--weight-buffer-bytes, the --model's bytes); the model: views over its prefix
 LoadParams / a transfer naming a model of another shape (ParamStore.lay_out_for) ─► ModelSwitch(path):
   layout for the checkpoint ─► too big for the buffer? FAILED_PRECONDITION naming both sizes
   views over the buffer's prefix ─► KV pages re-made in the same bytes (their count follows the
   shape) ─► the engine serves the new model (tokenizer, limits, model_id) ─► readiness: nothing, L' layers
```

Only while the weights are not complete and no batch is cached (FAILED_PRECONDITION otherwise): the
bytes that land next are the new model's. The KV cache keeps its bytes, not its page count: a model
with more layers or KV heads gets fewer pages. With `--cpu-onednn` packed weights the new model's
packs follow readiness in place of the old model's. Torch engine at `--tp 1` only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from replica.config import ReplicaConfig
from replica.engine import packing
from replica.engine.detokenizer import Detokenizer
from replica.engine.engine import Engine
from replica.engine.runner import ModelRunner
from replica.engine.validation import derive_limits
from replica.engine.warmup import MAX_GRAPH_BATCH
from replica.errors import FailedPrecondition
from replica.model import linear
from replica.model.attention import PagedKVCache
from replica.model.config import ModelConfig
from replica.model.layout import WeightLayout
from replica.model.llama import CausalLM, build_model
from replica.model.weights import dtype_name
from replica.params.readiness import Listener
from replica.params.store import ParamStore

log = logging.getLogger(__name__)


class ModelSwitch:
    """`ParamStore.relayout` of the torch engine: `switch(path)` makes the replica hold `path`'s model."""

    def __init__(self, engine: Engine, params: ParamStore, capacity: torch.Tensor, config: ReplicaConfig,
                 dtype: torch.dtype, packs: Listener | None = None) -> None:
        self.engine = engine
        self.packs = packs  # the packed weights' readiness listener of the model held now (--cpu-onednn)
        self.params = params
        self.capacity = capacity  # the whole flat buffer (uint8); the model's views cover its prefix
        self.config = config
        self.dtype = dtype
        self.kv_bytes = 0  # the KV cache's byte budget, kept across switches (pages round it down)

    def __call__(self, path: Path) -> None:
        """Lay the buffer and the KV pages out for the checkpoint at `path` (nothing loaded after)."""
        model_config = ModelConfig.from_dir(path)
        layout = WeightLayout.for_config(model_config, dtype_name(self.dtype))
        self._check(path, layout)
        engine, old, dtype = self.engine, self.engine.runner.cache, self.dtype
        per_old = PagedKVCache.bytes_per_block(engine.runner.config, old.block_size, dtype)
        held = old.num_blocks * per_old
        if not 0 <= self.kv_bytes - held < per_old:  # first switch, or Warmup resized the cache since
            self.kv_bytes = held
        per_block = PagedKVCache.bytes_per_block(model_config, old.block_size, dtype)
        num_blocks = max(self.kv_bytes // per_block, 1)  # the same bytes, the new shape's pages
        device = str(old.tensor.device)
        old.tensor = torch.empty(0, dtype=old.dtype)  # drop the old pages before the new ones are made
        view = self.capacity[: layout.total_bytes]
        model = build_model(model_config, layout, view, self.dtype)
        cache = PagedKVCache.for_model(model_config, num_blocks, old.block_size, self.dtype, device)
        runner = ModelRunner(model, cache, engine.meta.attention_backend)
        self.params.readiness.relayout(model_config.num_layers)  # the old packs (if any) dropped here
        self._follow(model)
        self.params.layout, self.params.buffer = layout, view
        limits = derive_limits(self.config, model_config)
        engine.switch_model(runner, Detokenizer.from_model_dir(path), limits, path.name)
        if engine.meta.cuda_graphs:
            runner.capture_graphs(min(MAX_GRAPH_BATCH, num_blocks))
        log.info("switched to %s: %d layers, %.1f MB of weights in a %.1f MB buffer, %d KV pages",
                 path.name, model_config.num_layers, layout.total_bytes / 1e6, self.capacity.numel() / 1e6,
                 num_blocks)

    def _follow(self, model: CausalLM) -> None:
        """--cpu-onednn: the new model's packs follow readiness instead of the old model's (or its
        kernels are warmed, without packed weights)."""
        readiness = self.params.readiness
        if self.packs is not None:
            readiness.unsubscribe(self.packs)
            self.packs = None
        if self.config.cpu_onednn and self.config.cpu_packed_weights:
            self.packs = packing.track(model, readiness)
        elif self.config.cpu_onednn:
            linear.warm(packing.linear_pairs(model))

    def _check(self, path: Path, layout: WeightLayout) -> None:
        need, room = layout.total_bytes, self.capacity.numel()
        if need > room:
            raise FailedPrecondition(
                f"model {path.name} needs {need} bytes of weights; this replica's weight buffer holds "
                f"{room} (start it with --weight-buffer-bytes {need} or more)")
        if len(self.engine.store):
            raise FailedPrecondition(f"cannot switch to model {path.name} while batches are cached")
