"""`pdcluster bench engine`: the engine's offline batch decode in this process, beside vLLM-CPU.

One batch of `--batch` requests (`--input-len` random prompt tokens, exactly `--output-len` new
tokens, greedy, EOS ignored, float32, `--torch-threads` torch threads) is prefilled and decoded to
the end on pdcluster's engine in this process, prefix caching off (`engine_baseline.py`'s
measurement: prefill batches cut as the router cuts them, then decode steps of the merged batch).
With `--peer vllm` the same prompts (same seed) run on vLLM's offline `LLM` in its own venv
(`--vllm-python`), as a long-lived subprocess (`vllm_peer.py`: float32, enforce_eager, prefix
caching off); its decode rate is (output_len - 1) x batch tokens over the difference between
`generate` with `output_len` new tokens and with one. After a warm-up of each, the two sides
alternate for `--rounds` rounds so that load from other work on the machine falls on both alike;
each round, the median and the best are reported with the ratio pdcluster / vLLM of decode
tokens/s (issue 25: goal >= 1.1). Without the vLLM interpreter the benchmark says so and measures
pdcluster alone. Unset `--model` builds the 54 M Llama of PEERS.md (`--quick`: the 2-layer tiny one).
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from pdcluster.bench.models import model_or_built

GOAL = 1.10  # pdcluster decode tokens/s over vLLM's
PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")
PEER_START_S = 900.0  # vLLM's start (spawned processes, profile run) takes minutes on shared cores


class Peer(enum.StrEnum):
    """What the engine is measured beside."""

    NONE = "none"
    VLLM = "vllm"


@dataclass(frozen=True)
class BenchEngineConfig:
    """Options of the engine benchmark."""

    json: Path | None = field(default=None, metadata={"help": "write the results as JSON to this file"})
    model: Path | None = field(
        default=None, metadata={"help": "checkpoint folder; unset = the 54 M-parameter Llama of PEERS.md"}
    )
    quick: bool = field(default=False, metadata={"help": "unset --model: the 2-layer tiny Llama instead"})
    peer: Peer = field(default=Peer.NONE, metadata={"help": "also run the same batch on this peer"})
    vllm_python: Path = field(
        default=Path("/work/vllm-venv/bin/python"),
        metadata={"help": "the interpreter of vLLM-CPU's own venv (docs/performance.md: how to make it)"},
    )
    batch: int = field(default=32, metadata={"help": "requests in the batch"})
    input_len: int = field(default=128, metadata={"help": "prompt tokens of every request"})
    output_len: int = field(default=64, metadata={"help": "new tokens of every request"})
    rounds: int = field(default=3, metadata={"help": "timed rounds per side, alternating"})
    torch_threads: int = field(
        default=1, metadata={"help": "torch intra-op threads here (0 = torch's default)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the prompts"})
    cpu_onednn: bool = field(default=True, metadata={"help": (
        "pdcluster's engine with the replica's --cpu-onednn (oneDNN linears and packed weights, the "
        "default); --no-cpu-onednn: F.linear")})

    def __post_init__(self) -> None:
        if min(self.batch, self.input_len, self.rounds) <= 0 or self.output_len < 2:
            raise ValueError("batch, input length and rounds must be positive, output length at least 2")


class VllmPeer:
    """vLLM's offline engine in its own interpreter, measured one round per request."""

    def __init__(self, config: BenchEngineConfig, model: Path) -> None:
        args = [
            str(config.vllm_python),
            str(PEER_SCRIPT),
            str(model),
            str(config.batch),
            str(config.input_len),
            str(config.output_len),
            str(config.seed),
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        env.pop("PYTHONPATH", None)  # pdcluster's tree must not shadow vLLM's packages
        self.process = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self._expect("ready")

    def _expect(self, what: str) -> str:
        """The peer's next stdout line (it answers within PEER_START_S, or the bench fails)."""
        assert self.process.stdout is not None
        import select

        ready, _, _ = select.select([self.process.stdout], [], [], PEER_START_S)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(
                f"the vLLM peer gave no {what} (exit {self.process.poll()}); see its stderr above"
            )
        return line.strip()

    def round(self, config: BenchEngineConfig) -> dict[str, float]:
        """One timed round: decode tokens/s and prefill tokens/s (prefill + first token)."""
        assert self.process.stdin is not None
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        times = json.loads(self._expect("round"))
        decode_s = times["full_s"] - times["first_s"]
        return {
            "decode_tokens_per_s": config.batch * (config.output_len - 1) / decode_s,
            "prefill_tokens_per_s": config.batch * config.input_len / times["first_s"],
        }

    def close(self) -> None:
        """Ask the peer to quit; kill it if it does not within 30 s."""
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=30)


def _pdcluster_side(config: BenchEngineConfig, model: Path) -> Any:
    """A function running one timed round on an in-process engine built once (warmed up)."""
    from pdcluster.bench.engine_baseline import build_baseline

    # prefix caching off, as on vLLM's side: every round computes its whole prompts
    return build_baseline(
        model, config.batch, config.input_len, config.output_len, seed=config.seed, prefix_cache=False,
        cpu_onednn=config.cpu_onednn,
    )


def measure(config: BenchEngineConfig, model: Path) -> dict[str, list[dict[str, float]]]:
    """Every round of each side, alternating (pdcluster first in each round)."""
    peer = None
    if config.peer is Peer.VLLM:
        if config.vllm_python.exists():
            peer = VllmPeer(config, model)  # started first: its start-up should not overlap our rounds
        else:
            print(f"no vLLM interpreter at {config.vllm_python}: measuring pdcluster only", file=sys.stderr)
    runs: dict[str, list[dict[str, float]]] = {"pdcluster": []}
    try:
        ours = _pdcluster_side(config, model)
        if peer is not None:
            runs["vllm"] = []
        for _ in range(config.rounds):
            runs["pdcluster"].append(ours())
            if peer is not None:
                runs["vllm"].append(peer.round(config))
    finally:
        if peer is not None:
            peer.close()
    return runs


def report(config: BenchEngineConfig, runs: dict[str, list[dict[str, float]]], model: str) -> dict[str, Any]:
    """The JSON report: every round, median and best of each side, the ratios, the goal."""
    sides: dict[str, dict[str, Any]] = {
        name: {
            "rounds": rounds,
            "decode_tokens_per_s_median": median(r["decode_tokens_per_s"] for r in rounds),
            "decode_tokens_per_s_best": max(r["decode_tokens_per_s"] for r in rounds),
            "prefill_tokens_per_s_median": median(r["prefill_tokens_per_s"] for r in rounds),
        }
        for name, rounds in runs.items()
    }
    out: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path | enum.Enum) else v for k, v in config.__dict__.items()},
        "model": model,
        "sides": sides,
        "goal": GOAL,
    }
    if "vllm" in sides:
        ours, theirs = sides["pdcluster"], sides["vllm"]
        out["decode_ratio_median"] = ours["decode_tokens_per_s_median"] / theirs["decode_tokens_per_s_median"]
        out["decode_ratio_best"] = ours["decode_tokens_per_s_best"] / theirs["decode_tokens_per_s_best"]
        out["decode_ratio_per_round"] = [
            a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
            for a, b in zip(runs["pdcluster"], runs["vllm"], strict=True)
        ]
        out["meets_goal"] = out["decode_ratio_median"] >= GOAL
    return out


def run(config: BenchEngineConfig) -> int:
    """Build (or take) the model, measure both sides, print and write the report."""
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model, name = model_or_built(config.model, config.quick, Path(tmp))
        out = report(config, measure(config, model), name)
    for side, figures in out["sides"].items():
        rates = ", ".join(f"{r['decode_tokens_per_s']:.0f}" for r in figures["rounds"])
        print(
            f"{side:<10} decode {figures['decode_tokens_per_s_median']:8.1f} tok/s median (rounds: {rates}); "
            f"prefill {figures['prefill_tokens_per_s_median']:8.1f} tok/s median"
        )
    if "decode_ratio_median" in out:
        print(
            f"pdcluster / vLLM decode: {out['decode_ratio_median']:.3f} median, "
            f"{out['decode_ratio_best']:.3f} best; "
            f"goal >= {GOAL}: {'met' if out['meets_goal'] else 'NOT met'}"
        )
    if config.json is not None:
        config.json.parent.mkdir(parents=True, exist_ok=True)
        config.json.write_text(json.dumps(out, indent=2))
    return 0
