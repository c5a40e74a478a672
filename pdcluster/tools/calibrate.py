"""`pdcluster calibrate`: time a model card's forward on this machine's GPU into a profile table.

```
 --model-card ─► one decoder layer of the card's shapes (random weights, the card's dtype):
                  q/k/v, o, gate/up, down GEMMs + SDPA attention (grouped K/V heads) + residuals
 prefill B × C: B sequences of C new tokens (causal)      ─┐  ms = layer × num_layers + head (B rows)
 decode  B × C: B sequences, one new token over C cached ─┴► OUT.csv  phase,batch_size,context_len,ms
                                                              OUT.json the provenance (GPU, torch,
                                                              card, dtype, command, per-row rates)
```
The CSV is what `--profile` reads (`replica/engine/sim/profile.py`): every batch size with every
context length per phase. Each point is the mean of `--reps` timed runs after `--warmup` untimed ones,
synchronised on the device. A layer is timed alone and multiplied by the card's layer count (the
layers are identical), so a card whose weights do not fit the GPU still calibrates; embedding
lookups and sampling are left out. Needs torch (imported only when it runs) and, for a GPU table,
CUDA; `--device cpu` runs the same code on the CPU (tests).
"""

from __future__ import annotations

import csv
import json
import platform
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from replica.engine.sim.cards import card_dict, card_dtype, load_card
from replica.model.config import ModelConfig


@dataclass
class CalibrateConfig:
    """Flags of `pdcluster calibrate`."""

    out: Path = field(metadata={"help": "the profile table to write (CSV); its provenance goes beside it "
                                        "(same name, .json)", "positional": True})
    model_card: str = field(default="llama-2-7b", metadata={
        "help": "a built-in card (replica/engine/sim/cards.py) or a config.json / folder / .toml"})
    device: str = field(default="cuda", metadata={"help": "torch device (cuda, cuda:1, cpu)"})
    dtype: str = field(default="", metadata={"help": "bfloat16 | float16 | float32; empty = the card's"})
    prefill_batch: list[int] = field(default_factory=lambda: [1, 2, 4], metadata={
        "help": "prefill batch sizes (sequences)"})
    prefill_context: list[int] = field(default_factory=lambda: [128, 512, 1024, 2048, 4096], metadata={
        "help": "prefill lengths (new tokens per sequence)"})
    decode_batch: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128], metadata={
        "help": "decode batch sizes (sequences)"})
    decode_context: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096], metadata={
        "help": "decode context lengths (cached tokens per sequence)"})
    reps: int = field(default=20, metadata={"help": "timed runs per point"})
    warmup: int = field(default=3, metadata={"help": "untimed runs per point"})

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        load_card(self.model_card)  # an unknown card → ValueError naming the built-in ones
        axes = (self.prefill_batch, self.prefill_context, self.decode_batch, self.decode_context)
        if any(not axis or min(axis) <= 0 for axis in axes):
            raise ValueError("every batch size and context length must be > 0 (and each list non-empty)")
        if self.reps <= 0 or self.warmup < 0:
            raise ValueError("--reps must be > 0 and --warmup >= 0")
        if self.dtype and self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {self.dtype!r}")


@dataclass(frozen=True)
class Point:
    """One measured row of the table."""

    phase: str
    batch_size: int
    context_len: int
    ms: float
    rate: float  # prefill: TFLOP/s of the dense and attention math; decode: GB/s of weights and K/V read


def dense_flops(card: ModelConfig, tokens: int) -> float:
    """FLOPs of one layer's GEMMs over `tokens` tokens."""
    h, q, kv, inter = card.hidden_size, card.q_size, card.kv_size, card.intermediate_size
    return 2.0 * tokens * (h * (q + 2 * kv) + q * h + 3 * h * inter)


class LayerBench:
    """One decoder layer of the card on a torch device (see module docstring)."""

    def __init__(self, card: ModelConfig, device: str, dtype: str) -> None:
        import torch

        self.torch, self.card, self.device = torch, card, torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        h, q, kv, inter = card.hidden_size, card.q_size, card.kv_size, card.intermediate_size
        gen = torch.Generator(device="cpu").manual_seed(0)

        def weight(rows: int, cols: int) -> Any:
            return (torch.randn(rows, cols, generator=gen) * 0.02).to(self.device, self.dtype)

        self.qkv, self.o = weight(q + 2 * kv, h), weight(h, q)
        self.gate_up, self.down = weight(2 * inter, h), weight(h, inter)
        self.head = weight(card.vocab_size, h)

    def _attend(self, x: Any, k: Any, v: Any, causal: bool) -> Any:
        """Attention of new tokens `x` (B, T, q) over `k`, `v` (B, kv_heads, S, head_dim)."""
        c, F = self.card, self.torch.nn.functional
        b, t = x.shape[0], x.shape[1]
        q = x.view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        groups = c.num_heads // c.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out.transpose(1, 2).reshape(b, t, c.q_size)

    def _layer(self, x: Any, kv_cache: tuple[Any, Any] | None) -> Any:
        """x: (B, T, hidden); kv_cache: (K, V) of the cached tokens, or None for a prefill."""
        c, F = self.card, self.torch.nn.functional
        b, t = x.shape[0], x.shape[1]
        q, k, v = (x @ self.qkv.T).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        k = k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if kv_cache is not None:  # attend over the cache in place (a paged engine appends, copies nothing)
            k, v = kv_cache
        x = x + self._attend(q, k, v, causal=kv_cache is None) @ self.o.T
        gate, up = (x @ self.gate_up.T).split(c.intermediate_size, dim=-1)
        return x + (F.silu(gate) * up) @ self.down.T

    def _time(self, fn: Callable[[], object], reps: int, warmup: int) -> float:
        """Mean seconds of `fn` (device-synchronised)."""
        torch = self.torch
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            for _ in range(warmup):
                fn()
            sync()
            began = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
        return (time.perf_counter() - began) / reps

    def prefill(self, batch: int, context: int, reps: int, warmup: int) -> Point:
        """B sequences of C new tokens."""
        torch, c = self.torch, self.card
        x = torch.randn(batch, context, c.hidden_size, device=self.device, dtype=self.dtype)
        layer = self._time(lambda: self._layer(x, None), reps, warmup)
        last = x[:, -1]
        head = self._time(lambda: last @ self.head.T, reps, warmup)
        seconds = layer * c.num_layers + head
        attention = 4.0 * c.q_size * batch * context * (context + 1) / 2
        flops = c.num_layers * (dense_flops(c, batch * context) + attention)
        return Point("prefill", batch, context, seconds * 1e3, flops / seconds / 1e12)

    def decode(self, batch: int, context: int, reps: int, warmup: int) -> Point:
        """B sequences of one new token after C cached ones."""
        torch, c = self.torch, self.card
        x = torch.randn(batch, 1, c.hidden_size, device=self.device, dtype=self.dtype)
        shape = (batch, c.num_kv_heads, context, c.head_dim)
        cache = (torch.randn(shape, device=self.device, dtype=self.dtype),
                 torch.randn(shape, device=self.device, dtype=self.dtype))
        layer = self._time(lambda: self._layer(x, cache), reps, warmup)
        last = x[:, -1]
        head = self._time(lambda: last @ self.head.T, reps, warmup)
        seconds = layer * c.num_layers + head
        weights = dense_flops(c, 1) / 2 * self.itemsize  # every GEMM weight read once
        kv = 2 * batch * context * c.kv_size * self.itemsize
        nbytes = c.num_layers * (weights + kv) + c.vocab_size * c.hidden_size * self.itemsize
        return Point("decode", batch, context, seconds * 1e3, nbytes / seconds / 1e9)

    def device_name(self) -> str:
        """What the device calls itself."""
        if self.device.type == "cuda":
            return str(self.torch.cuda.get_device_name(self.device))
        return f"cpu ({platform.processor() or platform.machine()})"


def measure(config: CalibrateConfig, report: Callable[[Point], None] | None = None
            ) -> tuple[list[Point], str]:
    """Every point of the grid (prefill rows, then decode rows) and the device's name."""
    card = load_card(config.model_card)
    bench = LayerBench(card, config.device, config.dtype or card_dtype(config.model_card))
    points = []
    for phase, batches, contexts in (("prefill", config.prefill_batch, config.prefill_context),
                                     ("decode", config.decode_batch, config.decode_context)):
        run = bench.prefill if phase == "prefill" else bench.decode
        for b in batches:
            for ctx in contexts:
                point = run(b, ctx, config.reps, config.warmup)
                points.append(point)
                if report is not None:
                    report(point)
    return points, bench.device_name()


def write_table(path: Path, points: list[Point]) -> None:
    """The profile CSV (`phase,batch_size,context_len,ms`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["phase", "batch_size", "context_len", "ms"])
        for p in points:
            writer.writerow([p.phase, p.batch_size, p.context_len, f"{p.ms:.3f}"])


def command(config: CalibrateConfig) -> str:
    """The `pdcluster calibrate` command line that measures `config`'s grid."""
    words = ["pdcluster", "calibrate", str(config.out), "--model-card", config.model_card,
             "--device", config.device]
    if config.dtype:
        words += ["--dtype", config.dtype]
    for name in ("prefill_batch", "prefill_context", "decode_batch", "decode_context"):
        words += [f"--{name.replace('_', '-')}", *map(str, getattr(config, name))]
    words += ["--reps", str(config.reps), "--warmup", str(config.warmup)]
    return shlex.join(words)


def provenance(config: CalibrateConfig, device: str, points: list[Point]) -> dict[str, Any]:
    """What made the table: the device, the software, the card and the command."""
    import torch

    card = card_dict(config.model_card)
    return {
        "device": device,
        "torch": torch.__version__,
        "model_card": config.model_card,
        "card": dict(card),
        "dtype": config.dtype or card_dtype(config.model_card),
        "method": "one decoder layer timed alone x num_hidden_layers + the LM head over each sequence's "
                  "last token; mean of reps after warmup, device-synchronised",
        "command": command(config),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "rates": [{"phase": p.phase, "batch_size": p.batch_size, "context_len": p.context_len,
                   "ms": round(p.ms, 3), "tflops" if p.phase == "prefill" else "gbps": round(p.rate, 1)}
                  for p in points],
    }


def run(config: CalibrateConfig) -> int:
    """Runner of `pdcluster calibrate`: 0 when the table is written."""
    def report(p: Point) -> None:
        unit = "TFLOP/s" if p.phase == "prefill" else "GB/s"
        print(f"{p.phase:7s} batch {p.batch_size:4d} context {p.context_len:6d}: {p.ms:9.3f} ms "
              f"({p.rate:.1f} {unit})", flush=True)

    points, device = measure(config, report)
    write_table(config.out, points)
    meta = config.out.with_suffix(".json")
    meta.write_text(json.dumps(provenance(config, device, points), indent=1) + "\n")
    print(f"pdcluster calibrate: {len(points)} points on {device} -> {config.out} (provenance: {meta})")
    return 0
