"""`pdcluster bench replica`: prefill and decode tokens/s (a) over gRPC, (b) in-process, (c) transformers.

For each batch size, B prompts of `--prompt-tokens` tokens are prefilled, then `--decode-steps`
decode steps run (EOS ignored so every step is full). (a) drives a `pdcluster replica` subprocess
with Prefill + DecodeV2; (b) calls the same engine in this process; (c) runs transformers'
`generate` on the same checkpoint (prefill = a 1-token generate; decode = the rest of a longer
generate). Each figure is the best of `--repeats` runs after one warm-up run. Goals: (a)/(b) ≥ 0.8;
(b) decode at batch 32 ≥ (c).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BenchReplicaConfig:
    """Options of the replica benchmark."""

    json: Path | None = field(default=None, metadata={"help": "write the results as JSON to this file"})
    model: Path | None = field(
        default=None, metadata={"help": "checkpoint folder; unset = a fresh tiny Llama"}
    )
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32], metadata={"help": "batch sizes"})
    prompt_tokens: int = field(default=64, metadata={"help": "prompt length of every request"})
    decode_steps: int = field(default=32, metadata={"help": "decode steps timed per run"})
    repeats: int = field(default=3, metadata={"help": "timed runs per figure (the best is kept)"})
    block_size: int = field(default=16, metadata={"help": "KV page size of the replica"})
    torch_threads: int = field(
        default=1, metadata={"help": "torch intra-op threads of every path (0 = torch's default)"}
    )

    def __post_init__(self) -> None:
        if min([self.prompt_tokens, self.decode_steps, self.repeats, *self.batch_sizes], default=1) <= 0:
            raise ValueError("sizes, steps and repeats must be positive")


@dataclass(frozen=True)
class Rates:
    """Tokens per second of one path at one batch size."""

    prefill: float
    decode: float


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[3 + (17 * b + 5 * i) % (vocab - 3) for i in range(length)] for b in range(batch)]


def _best(runs: int, fn: Callable[[int], tuple[float, float]]) -> tuple[float, float]:
    """Best (prefill seconds, decode seconds) of `runs` timed runs after one warm-up; fn gets a run id."""
    fn(1)  # warm-up
    results = [fn(2 + i) for i in range(runs)]
    return min(r[0] for r in results), min(r[1] for r in results)


# ----------------------------------------------------------------------------------------- (b)
def _engine_run(engine: Any, prompts: list[list[int]], steps: int, batch_id: int) -> tuple[float, float]:
    from replica.engine.types import BatchId, BatchSpec, DecodeInput, RequestId, RequestSpec, StoppingParams

    stopping = StoppingParams(max_new_tokens=steps + 1, ignore_eos=True)
    spec = BatchSpec(
        BatchId(batch_id),
        tuple(RequestSpec(RequestId(i), tuple(p), stopping=stopping) for i, p in enumerate(prompts)),
    )
    start = time.perf_counter()
    result = engine.prefill(spec)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        result = engine.decode([DecodeInput(BatchId(batch_id))])
    decode = time.perf_counter() - start
    assert result.batch is None
    return prefill, decode


def bench_in_process(config: BenchReplicaConfig, model: Path) -> dict[int, Rates]:
    """(b): the engine called directly."""
    from replica.config import ReplicaConfig
    from replica.engine.factory import build_engine

    engine = build_engine(
        ReplicaConfig(model=model, port=0, num_blocks=_blocks(config), block_size=config.block_size)
    )
    out = {}
    for batch in config.batch_sizes:
        prompts = _prompts(batch, config.prompt_tokens, engine.limits.vocab_size)
        pre, dec = _best(config.repeats, partial(_engine_run, engine, prompts, config.decode_steps))
        out[batch] = Rates(batch * config.prompt_tokens / pre, batch * config.decode_steps / dec)
    return out


def _blocks(config: BenchReplicaConfig) -> int:
    per_request = -(-(config.prompt_tokens + config.decode_steps + 1) // config.block_size)
    return per_request * max(config.batch_sizes) + 8


# ----------------------------------------------------------------------------------------- (a)
def _grpc_run(stub: Any, prompts: list[list[int]], steps: int, batch_id: int) -> tuple[float, float]:
    from protos import generate_pb2 as pb

    stopping = pb.StoppingCriteriaParameters(max_new_tokens=steps + 1, ignore_eos_token=True)
    requests = [pb.Request(id=i, input_tokens=p, stopping_parameters=stopping) for i, p in enumerate(prompts)]
    batch = pb.Batch(id=batch_id, requests=requests, size=len(requests))
    start = time.perf_counter()
    cached = stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=600).batch
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        response = stub.DecodeV2(pb.DecodeV2Request(batches=[cached]), timeout=600)
        cached = response.batch
    decode = time.perf_counter() - start
    assert not response.HasField("batch")
    return prefill, decode


@contextmanager
def _replica(config: BenchReplicaConfig, model: Path) -> Iterator[str]:
    cmd = [
        sys.executable,
        "-m",
        "scripts.cli",
        "replica",
        "--model",
        str(model),
        "--port",
        "0",
        "--num-blocks",
        str(_blocks(config)),
        "--block-size",
        str(config.block_size),
        "--torch-threads",
        str(config.torch_threads),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the replica prints its address once ready (or exits)
        if not line.strip():
            raise RuntimeError("the replica subprocess exited before serving")
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(30)


def bench_grpc(config: BenchReplicaConfig, model: Path, vocab: int) -> dict[int, Rates]:
    """(a): a replica subprocess over gRPC."""
    import grpc

    from protos import generate_pb2_grpc as pb_grpc

    out = {}
    with _replica(config, model) as address, grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        for batch in config.batch_sizes:
            prompts = _prompts(batch, config.prompt_tokens, vocab)
            pre, dec = _best(config.repeats, partial(_grpc_run, stub, prompts, config.decode_steps))
            out[batch] = Rates(batch * config.prompt_tokens / pre, batch * config.decode_steps / dec)
    return out


# ----------------------------------------------------------------------------------------- (c)
def bench_transformers(config: BenchReplicaConfig, model: Path, vocab: int) -> dict[int, Rates]:
    """(c): transformers `generate` (greedy, KV cache on) on the same checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()

    def generate(ids: torch.Tensor, new: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    out = {}
    for batch in config.batch_sizes:
        ids = torch.tensor(_prompts(batch, config.prompt_tokens, vocab))
        pre, total = _best(config.repeats, partial(_hf_run, generate, ids, config.decode_steps))
        out[batch] = Rates(
            batch * config.prompt_tokens / pre, batch * config.decode_steps / max(total - pre, 1e-9)
        )
    return out


def _hf_run(generate: Callable[[Any, int], float], ids: Any, steps: int, run_id: int) -> tuple[float, float]:
    return generate(ids, 1), generate(ids, steps + 1)


# ----------------------------------------------------------------------------------------- report
def _row(batch: int, a: Rates, p: Rates, c: Rates) -> dict[str, Any]:
    return {
        "batch": batch,
        "grpc": {"prefill_tok_s": a.prefill, "decode_tok_s": a.decode},
        "in_process": {"prefill_tok_s": p.prefill, "decode_tok_s": p.decode},
        "transformers": {"prefill_tok_s": c.prefill, "decode_tok_s": c.decode},
        "grpc_over_in_process": {"prefill": a.prefill / p.prefill, "decode": a.decode / p.decode},
        "in_process_over_transformers": {"prefill": p.prefill / c.prefill, "decode": p.decode / c.decode},
    }


def _report(
    config: BenchReplicaConfig, grpc_r: dict[int, Rates], proc_r: dict[int, Rates], hf_r: dict[int, Rates]
) -> dict[str, Any]:
    rows = [_row(b, grpc_r[b], proc_r[b], hf_r[b]) for b in config.batch_sizes]
    largest = max(config.batch_sizes)
    grpc_ratio = min(
        min(grpc_r[b].prefill / proc_r[b].prefill, grpc_r[b].decode / proc_r[b].decode)
        for b in config.batch_sizes
    )
    return {
        "config": {
            "prompt_tokens": config.prompt_tokens,
            "decode_steps": config.decode_steps,
            "repeats": config.repeats,
            "block_size": config.block_size,
            "torch_threads": config.torch_threads,
        },
        "results": rows,
        "goals": {
            "grpc_over_in_process_min": grpc_ratio,
            "grpc_over_in_process_goal": 0.8,
            "in_process_over_transformers_decode_at_largest_batch": proc_r[largest].decode
            / hf_r[largest].decode,
            "in_process_over_transformers_goal": 1.0,
        },
    }


def _print(report: dict[str, Any]) -> None:
    print(f"{'batch':>5} {'path':<13} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for row in report["results"]:
        for path in ("grpc", "in_process", "transformers"):
            r = row[path]
            print(f"{row['batch']:>5} {path:<13} {r['prefill_tok_s']:>14.0f} {r['decode_tok_s']:>13.0f}")
        a, b = row["grpc_over_in_process"], row["in_process_over_transformers"]
        print(
            f"      (a)/(b) prefill {a['prefill']:.2f} decode {a['decode']:.2f}; "
            f"(b)/(c) prefill {b['prefill']:.2f} decode {b['decode']:.2f}"
        )


def run(config: BenchReplicaConfig) -> int:
    """Run the three paths and print / write the report."""
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    with tempfile.TemporaryDirectory(prefix="bench-replica-") as tmp:
        model = config.model
        if model is None:
            from scripts.tiny_model import TinyModelConfig, make_tiny_model

            model = make_tiny_model(TinyModelConfig(out=Path(tmp) / "tiny", arch="llama"))
        from replica.model.config import ModelConfig

        vocab = ModelConfig.from_dir(model).vocab_size
        proc_r = bench_in_process(config, model)
        grpc_r = bench_grpc(config, model, vocab)
        hf_r = bench_transformers(config, model, vocab)
    report = _report(config, grpc_r, proc_r, hf_r)
    _print(report)
    if config.json is not None:
        config.json.parent.mkdir(parents=True, exist_ok=True)
        config.json.write_text(json.dumps(report, indent=2))
    return 0
