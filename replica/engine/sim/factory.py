"""Building a simulated GPU's engine and weight store from a `ReplicaConfig` (`--engine simulated`).

```
 --model-card ─► ModelConfig ─┬─ weight layout (real sizes) ─► KV pages = what --gpu's memory leaves
 --gpu ───────► GpuSpec ──────┤                                 after the weights (or --num-blocks)
 --profile ───► ProfileCost ──┴─ cost model (else the roofline) ─► SimRunner ─► Engine (the shared one)
 --byte-scale ─► the weight buffer and the KV pages: real sizes × scale, anonymous memory
 --model ─────► tokenizer.json only (texts, stop sequences); none = empty texts
```
"""

from __future__ import annotations

import logging
import math
import mmap
from pathlib import Path

from replica.config import ReplicaConfig
from replica.engine.detokenizer import Detokenizer
from replica.engine.engine import Engine, EngineMeta
from replica.engine.sim.cards import card_dtype, load_card
from replica.engine.sim.clock import SleepClock, StepClock
from replica.engine.sim.cost import CostModel, Roofline
from replica.engine.sim.gpus import GpuSpec, gpu
from replica.engine.sim.profile import ProfileCost
from replica.engine.sim.runner import SimKvCache, SimRunner
from replica.engine.sim.tokens import TokenPicker
from replica.engine.sim.weights import CardIO, scaled_layout
from replica.engine.validation import derive_limits
from replica.model.config import ModelConfig
from replica.model.layout import ITEMSIZE, WeightLayout
from replica.params.readiness import ParamReadiness
from replica.params.store import ParamStore

log = logging.getLogger(__name__)

RUNTIME_RESERVE_BYTES = 1 << 30
"""GPU memory neither weights nor KV pages get: the CUDA context, workspaces, graphs (1 GiB)."""


def kv_blocks(spec: GpuSpec, utilization: float, weight_bytes: int, config: ModelConfig, block_size: int,
              itemsize: int, max_prefill_tokens: int) -> int:
    """KV pages that fit in the GPU's memory once the weights, the runtime and the largest prefill's
    activations have theirs (vLLM's sizing: `utilization` of the memory, a profile run's peak)."""
    activations = max_prefill_tokens * (4 * config.hidden_size + 2 * config.intermediate_size) * itemsize
    budget = spec.memory_bytes * utilization - weight_bytes - RUNTIME_RESERVE_BYTES - activations
    per_block = config.num_layers * 2 * block_size * config.kv_size * itemsize
    if budget < per_block:
        raise ValueError(f"{weight_bytes / 1e9:.1f} GB of weights leave no KV room on a {spec.name}")
    return int(budget // per_block)


def cost_model(config: ReplicaConfig, card: ModelConfig, itemsize: int) -> CostModel:
    """The profile table's step times, else the roofline of the card on the GPU."""
    if config.profile is not None:
        return ProfileCost.load(config.profile, card.num_layers)
    return Roofline(card, itemsize, gpu(config.gpu), config.compute_efficiency, config.memory_efficiency)


def token_picker(detok: Detokenizer, card: ModelConfig, tokenizer_vocab: int | None) -> TokenPicker:
    """Ordinary ids of the card's vocabulary (and of the tokenizer's, when there is one)."""
    vocab = card.vocab_size if tokenizer_vocab is None else min(card.vocab_size, tokenizer_vocab)
    excluded = {*card.eos_token_ids, *detok.special_ids}
    if card.bos_token_id is not None:
        excluded.add(card.bos_token_id)
    return TokenPicker(vocab, excluded)


def build_simulated(config: ReplicaConfig, clock: StepClock | None = None) -> tuple[Engine, ParamStore]:
    """The engine (the shared `Engine` over a `SimRunner`) and its weight store (see module docstring)."""
    card, dtype, scale = load_card(config.model_card), card_dtype(config.model_card), config.scale
    spec, itemsize = gpu(config.gpu), ITEMSIZE[dtype]
    full = WeightLayout.for_config(card, dtype)
    limits = derive_limits(config, card)
    num_blocks = config.num_blocks or kv_blocks(spec, config.gpu_memory_utilization, full.total_bytes, card,
                                                config.block_size, itemsize, limits.max_prefill_tokens)
    layout = scaled_layout(full, scale)
    buffer = mmap.mmap(-1, layout.total_bytes)
    readiness = ParamReadiness(card.num_layers, loaded=not config.inactive)
    model = config.model
    root = config.model_root or (Path(model).resolve().parent if model is not None else Path.cwd())
    params = ParamStore(layout, buffer, readiness, root, config.disk_gbps * scale, config.host_gbps * scale,
                        io=CardIO(), host_cache_bytes=math.ceil(config.host_cache_bytes * scale),
                        model_name=Path(model).name if model is not None else "")
    if config.host_cache:
        params.warm_host_copy(Path(model or "."))  # the card is the checkpoint: nothing is read
    params.warm_host_models(config.host_models)
    detok = Detokenizer.from_model_dir(model) if model is not None else Detokenizer(None)
    cache = SimKvCache(card, num_blocks, config.block_size, dtype, itemsize, scale)
    picker = token_picker(detok, card, detok.vocab_size)
    runner = SimRunner(card, cache, cost_model(config, card, itemsize), clock or SleepClock(), picker,
                       itemsize, scale)
    meta = EngineMeta(model_id=config.name, dtype=dtype, device_type=f"simulated:{spec.name}",
                      device=f"simulated:{spec.name}", attention_backend="simulated",
                      prefix_cache=config.prefix_cache)
    log.info("simulated %s on a %s: %.1f GB of weights (%.1f MB here), %d KV pages of %d tokens "
             "(%d B per page and layer here, scale %g)", config.name, spec.name, full.total_bytes / 1e9,
             layout.total_bytes / 1e6, num_blocks, config.block_size, cache.page_bytes, scale)
    return Engine(runner, detok, limits, meta, readiness), params
