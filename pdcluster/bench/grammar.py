"""`pdcluster bench grammar`: what structured output adds to a decode step, against the same batch
unconstrained, in one run (issue 26: goal ≤ 10 % more step time at batch 32 on the 54 M model).

The engine runs in this process. Each variant prefills one batch of `--batch` requests of
`--prompt-tokens` random tokens and times `--decode-steps` decode steps (EOS ignored):

    free         no request has a grammar
    constrained  every request has the JSON Schema grammar `SCHEMA` (an array of at least 1000
                 objects with a string, an integer and a boolean: it cannot end within the steps)
    mixed        every other request has it (constrained and free rows in one batch)

The variants are interleaved `--repeats` times after a warm-up round, so load from other work falls
on them alike; the best and the median step time of each are reported, and the ratios
constrained / free and mixed / free (best and median). Unset `--model` builds the 54 M-parameter
Llama of PEERS.md (`--quick`: the 2-layer tiny one, to check the path).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from pdcluster.bench.models import model_or_built

GOAL = 1.10  # constrained step time / free step time
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer"},
                    "ok": {"type": "boolean"},
                },
                "required": ["name", "qty", "ok"],
            },
        }
    },
    "required": ["rows"],
}
VARIANTS = ("free", "constrained", "mixed")
# the 54 M-parameter Llama of PEERS.md


@dataclass(frozen=True)
class BenchGrammarConfig:
    """Options of the grammar benchmark."""

    json: Path | None = field(default=None, metadata={"help": "write the results as JSON to this file"})
    model: Path | None = field(
        default=None, metadata={"help": "checkpoint folder; unset = the 54 M-parameter Llama of PEERS.md"}
    )
    quick: bool = field(default=False, metadata={"help": "unset --model: the 2-layer tiny Llama instead"})
    batch: int = field(default=32, metadata={"help": "requests in the decode batch"})
    prompt_tokens: int = field(default=128, metadata={"help": "prompt length of every request"})
    decode_steps: int = field(default=32, metadata={"help": "decode steps timed per run"})
    repeats: int = field(default=3, metadata={"help": "timed runs per variant"})
    block_size: int = field(default=16, metadata={"help": "KV page size"})
    device: str = field(default="cpu", metadata={"help": "the engine's device (cpu, cuda, cuda:N)"})
    torch_threads: int = field(default=1, metadata={"help": "torch intra-op threads (0 = torch's default)"})

    def __post_init__(self) -> None:
        if min(self.batch, self.prompt_tokens, self.decode_steps, self.repeats, self.block_size) <= 0:
            raise ValueError("batch, prompt tokens, steps, repeats and block size must be positive")


def _engine(config: BenchGrammarConfig, model: Path) -> Any:
    from replica.config import ReplicaConfig
    from replica.engine.factory import build_engine

    per_request = -(-(config.prompt_tokens + config.decode_steps + 1) // config.block_size)
    blocks = per_request * config.batch + 8
    return build_engine(
        ReplicaConfig(
            model=model, port=0, num_blocks=blocks, block_size=config.block_size, device=config.device
        )
    )


def _step_seconds(
    engine: Any, config: BenchGrammarConfig, prompts: list[list[int]], variant: str, run: int
) -> float:
    """Mean seconds per decode step of one run of `variant`."""
    from replica.engine.types import (
        BatchId,
        BatchSpec,
        DecodeInput,
        GrammarKind,
        GrammarSpec,
        RequestId,
        RequestSpec,
        StoppingParams,
    )

    grammar = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    stopping = StoppingParams(
        max_new_tokens=config.decode_steps + 2, ignore_eos=True
    )  # alive after the last step
    constrained = {
        "free": set(),
        "constrained": set(range(len(prompts))),
        "mixed": set(range(0, len(prompts), 2)),
    }
    requests = tuple(
        RequestSpec(
            RequestId(i), tuple(p), stopping=stopping, grammar=grammar if i in constrained[variant] else None
        )
        for i, p in enumerate(prompts)
    )
    result = engine.prefill(BatchSpec(BatchId(run), requests))
    start = time.perf_counter()
    for _ in range(config.decode_steps):
        result = engine.decode([DecodeInput(BatchId(run))])
    seconds = (time.perf_counter() - start) / config.decode_steps
    if result.batch is None or result.batch.size != len(prompts):  # a grammar ended a request early
        raise RuntimeError(f"{variant}: a request finished within the timed steps: not batch {len(prompts)}")
    engine.clear(BatchId(run))
    return seconds


def mask_seconds(engine: Any, batch: int, iterations: int = 50) -> float:
    """Seconds of one step's masking alone (`grammar.masked`: every row's bitmask filled, then applied)
    for `batch` constrained rows, on the engine's device: the grammar's own cost, model aside."""
    import torch

    from replica.engine.grammar import masked
    from replica.engine.types import GrammarKind, GrammarSpec, RowInput, SamplingParams

    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    rows = [RowInput(SamplingParams(), [1], 1, 0, engine.grammars.state(spec, [])) for _ in range(batch)]
    device = torch.device(engine.meta.device)
    logits = torch.randn(batch, engine.limits.vocab_size, device=device)
    masked(logits, rows)
    start = time.perf_counter()
    for _ in range(iterations):
        out = masked(logits, rows)
    out.sum().item()  # waits for the device
    return (time.perf_counter() - start) / iterations


def measure(config: BenchGrammarConfig, model: Path) -> dict[str, list[float]]:
    """Seconds per decode step of every timed run, by variant (and `mask`: the masking alone)."""
    engine = _engine(config, model)
    vocab = engine.limits.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(config.prompt_tokens)] for _ in range(config.batch)]
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    run_id = 0
    for repeat in range(config.repeats + 1):  # the first round warms up (grammar compiled, caches filled)
        for variant in VARIANTS:
            run_id += 1
            seconds = _step_seconds(engine, config, prompts, variant, run_id)
            if repeat:
                runs[variant].append(seconds)
    runs["mask"] = [mask_seconds(engine, config.batch) for _ in range(config.repeats)]
    return runs


def report(config: BenchGrammarConfig, runs: dict[str, list[float]], model: str) -> dict[str, Any]:
    """The JSON report: per variant best / median ms per step, ratios to free, the goal."""
    best = {v: min(s) for v, s in runs.items()}
    mid = {v: median(s) for v, s in runs.items()}
    mask = {"best": best["mask"] * 1e3, "median": mid["mask"] * 1e3}
    ratio = {v: best[v] / best["free"] for v in VARIANTS}
    ratio_median = {v: mid[v] / mid["free"] for v in VARIANTS}
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in config.__dict__.items()},
        "model": model,
        "schema": SCHEMA,
        "step_ms": {
            v: {"best": best[v] * 1e3, "median": mid[v] * 1e3, "runs": [s * 1e3 for s in runs[v]]}
            for v in VARIANTS
        },
        "ratio_to_free": ratio,
        "ratio_to_free_median": ratio_median,
        # the masking alone (all rows constrained), and what the constrained step added to the free one
        "mask_ms": mask,
        "added_ms": (best["constrained"] - best["free"]) * 1e3,
        "goal": GOAL,
        "meets_goal": ratio["constrained"] <= GOAL,
    }


def run(config: BenchGrammarConfig) -> int:
    """Build (or take) the model, measure, print and write the report."""
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    with tempfile.TemporaryDirectory(prefix="bench-grammar-") as tmp:
        model, name = model_or_built(config.model, config.quick, Path(tmp))
        out = report(config, measure(config, model), name)
    for variant in VARIANTS:
        step = out["step_ms"][variant]
        print(
            f"{variant:<12} {step['best']:8.2f} ms/step best, {step['median']:8.2f} median; "
            f"/ free {out['ratio_to_free'][variant]:.3f} (median {out['ratio_to_free_median'][variant]:.3f})"
        )
    print(
        f"masking alone: {out['mask_ms']['best']:.3f} ms/step best; "
        f"constrained - free: {out['added_ms']:.3f} ms"
    )
    print(f"goal: constrained / free <= {GOAL}: {'met' if out['meets_goal'] else 'NOT met'}")
    if config.json is not None:
        config.json.parent.mkdir(parents=True, exist_ok=True)
        config.json.write_text(json.dumps(out, indent=2))
    return 0
