"""Where every weight lives in the flat per-shard weight buffer (pure Python, no torch).

The buffer is cut into ordered, contiguous regions `embed | layer 0 | … | layer L-1 | head`; the
transfer layer moves regions and the replica counts readiness by them (embed ready, layers loaded,
head ready). Each region lists its tensors by Hugging Face name with shape, dtype and byte offset.
Tensor offsets are aligned (64 bytes by default) and each region is padded to the alignment, so
regions tile the buffer exactly: region i ends where region i+1 begins.

Tensor parallelism: a `Shard` (rank of world) names this buffer's slice. Column-parallel weights
(q/k/v, gate/up, embed and lm_head rows) are split along dim 0, row-parallel ones (o, down) along
dim 1, norms are replicated; the shapes are per shard. K/V projections are cut in whole KV heads;
with fewer KV heads than ranks each head is held by `world / kv_heads` ranks (`TensorSpec.parts`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from replica.model.config import DTYPES, ModelConfig, UnsupportedModel

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_ALIGNMENT = 64


class RegionKind(enum.Enum):
    """What a region holds (readiness is counted per kind)."""

    EMBED = "embed"
    LAYER = "layer"
    HEAD = "head"


class Split(enum.Enum):
    """How a tensor is cut across tensor-parallel ranks."""

    REPLICATED = "replicated"
    ROWS = "rows"  # dim 0 (column-parallel linear, embedding rows)
    COLUMNS = "columns"  # dim 1 (row-parallel linear)


@dataclass(frozen=True)
class Shard:
    """This buffer's tensor-parallel slice: `rank` of `world`."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"shard rank {self.rank} outside world {self.world}")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor in the buffer: HF name, per-shard shape, dtype name, absolute byte offset."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    split: Split = Split.REPLICATED
    parts: int = 0  # distinct slices along the split dim (0: one per rank); rank r holds r * parts // world

    @property
    def numel(self) -> int:
        """Number of elements."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        """Size in bytes (without alignment padding)."""
        return self.numel * ITEMSIZE[self.dtype]

    @property
    def end(self) -> int:
        """Byte offset just past the tensor."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Region:
    """A contiguous byte range of the buffer holding whole tensors (incl. trailing alignment padding)."""

    name: str
    kind: RegionKind
    index: int  # layer number for LAYER regions, 0 otherwise
    offset: int
    nbytes: int
    tensors: tuple[TensorSpec, ...]

    @property
    def end(self) -> int:
        """Byte offset just past the region."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class WeightLayout:
    """The ordered regions of one shard's flat weight buffer."""

    regions: tuple[Region, ...]
    total_bytes: int
    dtype: str
    shard: Shard
    alignment: int
    tied_embeddings: bool

    def tensors(self) -> dict[str, TensorSpec]:
        """All tensors by HF name, in buffer order (a tied lm_head is not listed: it is the embedding)."""
        return {t.name: t for region in self.regions for t in region.tensors}

    def region(self, name: str) -> Region:
        """The region called `name` (`embed`, `layer.<i>`, `head`)."""
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(f"no region {name!r}")

    def segments(self) -> list[tuple[int, int]]:
        """(offset, length) of every region in order: what the transfer layer registers and moves."""
        return [(r.offset, r.nbytes) for r in self.regions]

    def signature(self) -> dict[str, object]:
        """A JSON-able summary two replicas compare before exchanging weights (same bytes, same places)."""
        return {
            "dtype": self.dtype,
            "shard": [self.shard.rank, self.shard.world],
            "alignment": self.alignment,
            "total_bytes": self.total_bytes,
            "regions": [[r.name, r.offset, r.nbytes] for r in self.regions],
        }

    @property
    def lm_head(self) -> TensorSpec:
        """The output projection; with tied embeddings this is the embedding tensor itself."""
        name = EMBED_NAME if self.tied_embeddings else LM_HEAD_NAME
        return self.tensors()[name]

    @classmethod
    def for_config(
        cls,
        config: ModelConfig,
        dtype: str,
        shard: Shard | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> WeightLayout:
        """Lay out `config`'s weights in `dtype` for `shard` (TP=1 unless given)."""
        if dtype not in DTYPES:
            raise UnsupportedModel(f"weight dtype {dtype!r} not supported (supported: {', '.join(DTYPES)})")
        shard = shard or Shard()
        _check_divisible(config, shard)
        builder = _Builder(dtype, shard, alignment)
        for kind, index, name, entries in _region_entries(config, shard.world):
            builder.add_region(name, kind, index, entries)
        return cls(
            tuple(builder.regions), builder.cursor, dtype, shard, alignment, config.tie_word_embeddings
        )


EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"
NORM_NAME = "model.norm.weight"

# (name, full shape, split, distinct parts (0: one per rank))
_Entry = tuple[str, tuple[int, ...], Split, int]


def _layer_entries(config: ModelConfig, i: int, world: int) -> list[_Entry]:
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    # fewer KV heads than ranks: one head per rank, each held by world / kv_heads ranks
    kv_parts = config.num_kv_heads if config.num_kv_heads < world else 0
    p = f"model.layers.{i}."
    # q, k, v back to back (and gate, up) so the model can use them as one fused matrix when adjacent.
    entries: list[_Entry] = [
        (p + "input_layernorm.weight", (h,), Split.REPLICATED, 0),
        (p + "self_attn.q_proj.weight", (q, h), Split.ROWS, 0),
        (p + "self_attn.k_proj.weight", (kv, h), Split.ROWS, kv_parts),
        (p + "self_attn.v_proj.weight", (kv, h), Split.ROWS, kv_parts),
    ]
    if config.qkv_bias:
        entries += [
            (p + f"self_attn.{n}_proj.bias", (size,), Split.ROWS, parts)
            for n, size, parts in (("q", q, 0), ("k", kv, kv_parts), ("v", kv, kv_parts))
        ]
    entries.append((p + "self_attn.o_proj.weight", (h, q), Split.COLUMNS, 0))
    if config.o_bias:
        entries.append((p + "self_attn.o_proj.bias", (h,), Split.REPLICATED, 0))
    entries += [
        (p + "post_attention_layernorm.weight", (h,), Split.REPLICATED, 0),
        (p + "mlp.gate_proj.weight", (inter, h), Split.ROWS, 0),
        (p + "mlp.up_proj.weight", (inter, h), Split.ROWS, 0),
        (p + "mlp.down_proj.weight", (h, inter), Split.COLUMNS, 0),
    ]
    if config.mlp_bias:
        entries += [(p + f"mlp.{n}_proj.bias", (inter,), Split.ROWS, 0) for n in ("gate", "up")]
        entries.append((p + "mlp.down_proj.bias", (h,), Split.REPLICATED, 0))
    return entries


def _region_entries(config: ModelConfig, world: int) -> list[tuple[RegionKind, int, str, list[_Entry]]]:
    embed: list[_Entry] = [(EMBED_NAME, (config.vocab_size, config.hidden_size), Split.ROWS, 0)]
    head: list[_Entry] = [(NORM_NAME, (config.hidden_size,), Split.REPLICATED, 0)]
    if not config.tie_word_embeddings:
        head.append((LM_HEAD_NAME, (config.vocab_size, config.hidden_size), Split.ROWS, 0))
    layers = [
        (RegionKind.LAYER, i, f"layer.{i}", _layer_entries(config, i, world))
        for i in range(config.num_layers)
    ]
    return [(RegionKind.EMBED, 0, "embed", embed), *layers, (RegionKind.HEAD, 0, "head", head)]


def _check_divisible(config: ModelConfig, shard: Shard) -> None:
    dims = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    bad = [f"{name}={value}" for name, value in dims.items() if value % shard.world]
    if config.num_kv_heads < shard.world and shard.world % config.num_kv_heads == 0:
        bad.remove(f"num_key_value_heads={config.num_kv_heads}")  # replicated: whole heads per rank
    if bad:
        raise UnsupportedModel(f"tensor parallel degree {shard.world} does not divide {', '.join(bad)}")


def shard_shape(shape: tuple[int, ...], split: Split, world: int, parts: int = 0) -> tuple[int, ...]:
    """The per-rank shape of a tensor of full `shape` cut `split` into `parts` (0: `world`) slices."""
    parts = parts or world
    if split is Split.ROWS:
        return (shape[0] // parts, *shape[1:])
    if split is Split.COLUMNS:
        return (shape[0], shape[1] // parts, *shape[2:])
    return shape


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class _Builder:
    """Appends aligned tensors region by region."""

    def __init__(self, dtype: str, shard: Shard, alignment: int) -> None:
        if alignment <= 0 or alignment % ITEMSIZE[dtype]:
            raise ValueError(f"alignment {alignment} must be a positive multiple of the item size")
        self.dtype, self.shard, self.alignment = dtype, shard, alignment
        self.cursor = 0
        self.regions: list[Region] = []

    def add_region(self, name: str, kind: RegionKind, index: int, entries: list[_Entry]) -> None:
        start = self.cursor
        specs = []
        for tensor_name, shape, split, parts in entries:
            per_rank = shard_shape(shape, split, self.shard.world, parts)
            spec = TensorSpec(tensor_name, per_rank, self.dtype, self.cursor, split, parts)
            specs.append(spec)
            self.cursor = _align(spec.end, self.alignment)
        self.regions.append(Region(name, kind, index, start, self.cursor - start, tuple(specs)))
