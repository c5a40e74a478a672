"""The options of `pdcluster bench gpu` (pure Python: `--help` imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.bench import gpu_roofline as rl


def _ints(text: str, name: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise ValueError(f"--{name} must list positive integers, e.g. 1,8,32, got {text!r}")
    return values


@dataclass(frozen=True)
class BenchGpuConfig:
    """Options of `pdcluster bench gpu`."""

    model: Path | None = field(default=None, metadata={
        "help": "checkpoint folder; unset = random weights of --shape made in device memory"})
    shape: str = field(default="llama-2-7b", metadata={
        "help": "model shape of the random weights (tiny: for CPU runs)", "choices": sorted(rl.SHAPES)})
    device: str = field(default="auto", metadata={
        "help": "cpu, cuda, cuda:N, or auto (cuda:0 where present)"})
    dtype: str = field(default="bfloat16", metadata={
        "help": "weight and KV dtype", "choices": ["bfloat16", "float16", "float32"]})
    decode_batches: str = field(default="1,8,32,64", metadata={"help": "decode batch sizes"})
    contexts: str = field(default="1024,4096", metadata={
        "help": "decode context lengths: tokens each sequence attends to, the new one included"})
    prefill_tokens: str = field(default="512,2048,8192", metadata={"help": "prefill prompt lengths"})
    steps: int = field(default=10, metadata={"help": "decode steps per timed run"})
    repeats: int = field(default=3, metadata={"help": "timed runs per figure (best kept, median reported)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    attention_backend: str = field(default="auto", metadata={
        "help": "paged attention: auto, torch or triton (as the replica's flag)",
        "choices": ["auto", "torch", "triton"]})
    cuda_graphs: bool = field(default=True, metadata={
        "help": "also time decode through captured CUDA graphs (eager is always timed)"})
    matmul_size: int = field(default=8192, metadata={"help": "n of the n x n x n matmul of the FLOP/s limit"})
    copy_mib: int = field(default=1024, metadata={"help": "MiB copied by the bandwidth limit's copy_"})
    headroom_gib: float = field(default=2.0, metadata={
        "help": "GiB of free device memory kept for activations and graphs when sizing caches"})
    profile: bool = field(default=False, metadata={
        "help": "write a torch.profiler table of batch-1 decode steps into the JSON"})
    json: Path | None = field(default=None, metadata={"help": "write the results as JSON to this file"})
    plot: Path | None = field(default=None, metadata={
        "help": "write the PNG here; unset = beside --json (same name, .png)"})

    def __post_init__(self) -> None:
        for name in ("decode_batches", "contexts", "prefill_tokens"):
            _ints(getattr(self, name), name.replace("_", "-"))
        if min(self.steps, self.repeats, self.block_size, self.matmul_size, self.copy_mib) <= 0:
            raise ValueError("--steps, --repeats, --block-size, --matmul-size and --copy-mib must be "
                             "positive")
        if self.headroom_gib < 0:
            raise ValueError("--headroom-gib must be >= 0")

    @property
    def batches(self) -> list[int]:
        """Decode batch sizes, ascending."""
        return sorted(set(_ints(self.decode_batches, "decode-batches")))

    @property
    def context_lengths(self) -> list[int]:
        """Decode contexts, ascending."""
        return sorted(set(_ints(self.contexts, "contexts")))

    @property
    def prefill_lengths(self) -> list[int]:
        """Prefill lengths, ascending."""
        return sorted(set(_ints(self.prefill_tokens, "prefill-tokens")))

    @property
    def plot_path(self) -> Path | None:
        """Where the PNG goes (None: nowhere)."""
        if self.plot is not None:
            return self.plot
        return None if self.json is None else self.json.with_suffix(".png")
