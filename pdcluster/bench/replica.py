"""`pdcluster bench replica`: prefill and decode tokens/s (a) over gRPC, (b) in-process, (c) transformers.

For each batch size, a batch of B prompts of `--prompt-tokens` tokens is prefilled
`--prefill-rounds` times (each a new batch, the earlier ones cleared), then the last one runs
`--decode-steps` decode steps (EOS ignored so every step is full). (a) drives a `pdcluster replica`
subprocess with PrefillV2 + DecodeV2, twice: one call at a time (`grpc`), and pipelined as the
router's loops drive a replica (`grpc_pipelined`, the goal's figure: a prefill loop keeps
`router.loops.PREFILL_DEPTH` PrefillV2 calls on the wire, a decode loop `PIPELINE_DEPTH` DecodeV2
ordered by metadata); ClearCache calls are sent
without waiting for them, as the router's are off the step path; (b) calls the
same engine in this process; (c) runs transformers' `generate` on the same checkpoint (prefill = a
1-token generate; decode = the rest of a longer generate). Each figure is the best of `--repeats`
runs after one warm-up round, and the median run is reported alongside (on a machine shared with
other work a burst of load can spoil one path's best of three; the median is the steadier ratio);
the paths' runs are interleaved so that such work loads them alike. The replica of (a) serves gRPC
from its front process (`--no-grpc-frontend`: the single-process server, for comparison).
Goals: (a)/(b) ≥ 0.8; (b) decode at batch 32 ≥ (c).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

from pdcluster.cluster.replica_process import ReplicaProcess
from router.loops import PIPELINE_DEPTH, PREFILL_DEPTH

REPLICA_READY_TIMEOUT = 300.0  # seconds (a)'s replica may take to load the model and serve


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
    prefill_rounds: int = field(default=4, metadata={"help": "prefills (of the whole batch) timed per run"})
    repeats: int = field(default=3, metadata={"help": "timed runs per figure (the best is kept)"})
    block_size: int = field(default=16, metadata={"help": "KV page size of the replica"})
    torch_threads: int = field(
        default=1, metadata={"help": "torch intra-op threads of every path (0 = torch's default)"}
    )
    grpc_frontend: bool = field(
        default=True,
        metadata={"help": "(a)'s replica serves gRPC from its front process (the default of a replica)"},
    )
    pin: bool = field(
        default=True,
        metadata={
            "help": "with 2+ cores: the engine on the last core in every path ((a)'s replica through "
            "--engine-cpus, (b) and (c) in this process), the client and the replica's other threads "
            "on the rest, as the client would be on another host"
        },
    )

    def __post_init__(self) -> None:
        sizes = [self.prompt_tokens, self.decode_steps, self.repeats, self.prefill_rounds, *self.batch_sizes]
        if min(sizes, default=1) <= 0:
            raise ValueError("sizes, steps, rounds and repeats must be positive")
        if self.prefill_rounds >= _ROUND_IDS:
            raise ValueError(f"at most {_ROUND_IDS - 1} prefill rounds")


@dataclass(frozen=True)
class Rates:
    """Tokens per second of one path at one batch size: best run, and median run (robust to bursts
    of load from other processes on a shared machine, which the best of a few runs is not)."""

    prefill: float
    decode: float
    prefill_median: float = 0.0
    decode_median: float = 0.0


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[3 + (17 * b + 5 * i) % (vocab - 3) for i in range(length)] for b in range(batch)]


# A path runs (prompts, decode steps, a fresh run id) and returns (seconds per prefill of the
# batch, decode seconds); run r's batches are r * _ROUND_IDS + round.
Runner = Callable[[list[list[int]], int, int], tuple[float, float]]
_ROUND_IDS = 100


# ----------------------------------------------------------------------------------------- (b)
def _engine_run(
    engine: Any, rounds: int, prompts: list[list[int]], steps: int, run_id: int
) -> tuple[float, float]:
    from replica.engine.types import BatchId, BatchSpec, DecodeInput, RequestId, RequestSpec, StoppingParams

    stopping = StoppingParams(max_new_tokens=steps + 1, ignore_eos=True)
    ids = [BatchId(run_id * _ROUND_IDS + r) for r in range(rounds)]
    specs = [
        BatchSpec(
            batch_id,
            tuple(
                RequestSpec(RequestId(r * len(prompts) + i), tuple(p), stopping=stopping)
                for i, p in enumerate(prompts)
            ),
        )
        for r, batch_id in enumerate(ids)
    ]
    start = time.perf_counter()
    for n, spec in enumerate(specs):
        if n:
            engine.clear(ids[n - 1])
        result = engine.prefill(spec)
    prefill = (time.perf_counter() - start) / rounds
    batch_id = ids[-1]
    start = time.perf_counter()
    for _ in range(steps):
        result = engine.decode([DecodeInput(BatchId(batch_id))])
    decode = time.perf_counter() - start
    assert result.batch is None
    return prefill, decode


def in_process_path(config: BenchReplicaConfig, model: Path) -> Runner:
    """(b): the engine called directly."""
    from replica.config import ReplicaConfig
    from replica.engine.factory import build_engine

    engine = build_engine(
        ReplicaConfig(model=model, port=0, num_blocks=_blocks(config), block_size=config.block_size)
    )
    return partial(_engine_run, engine, config.prefill_rounds)


@dataclass(frozen=True)
class Cores:
    """Where each path runs (`--pin`): the engine's core, and the client's (and front's) cores."""

    engine: frozenset[int]
    client: frozenset[int]

    @classmethod
    def plan(cls, pin: bool, allowed: set[int]) -> Cores | None:
        """The last allowed core for the engine, the others for the client; None = no placement."""
        ordered = sorted(allowed)
        if not pin or len(ordered) < 2:
            return None
        return cls(frozenset(ordered[-1:]), frozenset(ordered[:-1]))

    def describe(self) -> str:
        """For the report."""
        return f"engine on cores {sorted(self.engine)}, gRPC client and front on {sorted(self.client)}"


def _on_cores(cpus: frozenset[int], run: Runner) -> Runner:
    """`run`, with every thread of this process on `cpus` while it runs."""
    from replica.placement import set_process_cpus

    def pinned(prompts: list[list[int]], steps: int, run_id: int) -> tuple[float, float]:
        set_process_cpus(cpus)
        return run(prompts, steps, run_id)

    return pinned


def _blocks(config: BenchReplicaConfig) -> int:
    per_request = -(-(config.prompt_tokens + config.decode_steps + 1) // config.block_size)
    # pipelined prefills: PREFILL_DEPTH batches on the wire, and the ClearCache of the one before
    # may reach the engine after the next PrefillV2 (separate calls): one more batch can be alive
    return (PREFILL_DEPTH + 1) * per_request * max(config.batch_sizes) + 8


# ----------------------------------------------------------------------------------------- (a)
def _grpc_prefills(stub: Any, batches: list[Any], depth: int) -> Any:
    """PrefillV2 of every batch with up to `depth` on the wire; each but the last is cleared with a
    ClearCache sent without waiting (checked at the end). The last batch's CachedBatch."""
    from collections import deque

    from protos import generate_pb2 as pb

    pending: deque[Any] = deque()
    clears: list[Any] = []
    cached: Any = None

    def collect() -> None:
        nonlocal cached
        cached = pending.popleft().result().batch
        if cached.id != batches[-1].id:
            clears.append(stub.ClearCache.future(pb.ClearCacheRequest(id=cached.id), timeout=600))

    for batch in batches:
        if len(pending) == depth:
            collect()
        pending.append(stub.PrefillV2.future(pb.PrefillV2Request(batch=batch), timeout=600))
    while pending:
        collect()
    for clear in clears:
        clear.result()
    return cached


def _grpc_run(
    stub: Any,
    rounds: int,
    prefill_depth: int,
    depth: int,
    prompts: list[list[int]],
    steps: int,
    run_id: int,
) -> tuple[float, float]:
    """`rounds` prefills with up to `prefill_depth` on the wire, then `steps` DecodeV2 calls with up
    to `depth` on the wire (1 and 1: one call at a time)."""
    from collections import deque

    from protos import generate_pb2 as pb
    from replica.server.ordering import AFTER_KEY, CALL_KEY

    stopping = pb.StoppingCriteriaParameters(max_new_tokens=steps + 1, ignore_eos_token=True)
    batches = []
    for r in range(rounds):  # request ids are unique across the batches alive at once
        requests = [
            pb.Request(id=r * len(prompts) + i, input_tokens=p, stopping_parameters=stopping)
            for i, p in enumerate(prompts)
        ]
        batches.append(pb.Batch(id=run_id * _ROUND_IDS + r, requests=requests, size=len(requests)))
    start = time.perf_counter()
    cached = _grpc_prefills(stub, batches, prefill_depth)
    prefill = (time.perf_counter() - start) / rounds
    batch_id = cached.id
    request = pb.DecodeV2Request(batches=[cached])  # the replica keeps the tokens: same batch each step
    pending: deque[Any] = deque()

    def send(n: int) -> None:  # call n follows call n - 1 on the replica (replica/server/ordering.py)
        meta = [(CALL_KEY, f"bench-{batch_id}-{n}")]
        meta += [(AFTER_KEY, f"bench-{batch_id}-{n - 1}")] if n else []
        pending.append(stub.DecodeV2.future(request, timeout=600, metadata=meta))

    start = time.perf_counter()
    for n in range(min(depth, steps)):
        send(n)
    for n in range(steps):
        response = pending.popleft().result()
        if n + depth < steps:
            send(n + depth)
    decode = time.perf_counter() - start
    assert not response.HasField("batch")
    return prefill, decode


def _replica(config: BenchReplicaConfig, model: Path, cores: Cores | None) -> ReplicaProcess:
    """(a)'s replica subprocess, serving once this returns (stopped by leaving its `with`)."""
    args = ["--num-blocks", str(_blocks(config)), "--block-size", str(config.block_size),
            "--torch-threads", str(config.torch_threads),
            "--grpc-frontend" if config.grpc_frontend else "--no-grpc-frontend"]
    if cores is not None:
        args += ["--engine-cpus", *map(str, sorted(cores.engine))]
    return ReplicaProcess.start(model, *args, timeout=REPLICA_READY_TIMEOUT)


# ----------------------------------------------------------------------------------------- (c)
def transformers_path(model: Path) -> Runner:
    """(c): transformers `generate` (greedy, KV cache on) on the same checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

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

    def run(prompts: list[list[int]], steps: int, run_id: int) -> tuple[float, float]:
        ids = torch.tensor(prompts)
        prefill = generate(ids, 1)
        return prefill, max(generate(ids, steps + 1) - prefill, 1e-9)

    return run


def measure(config: BenchReplicaConfig, paths: dict[str, Runner], vocab: int) -> dict[str, dict[int, Rates]]:
    """Best rates of every path per batch size; the paths' runs are interleaved so they share the load."""
    out: dict[str, dict[int, Rates]] = {name: {} for name in paths}
    run_ids = iter(range(1, 10**9))
    for batch in config.batch_sizes:
        prompts = _prompts(batch, config.prompt_tokens, vocab)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        for repeat in range(config.repeats + 1):
            for name, run in paths.items():
                result = run(prompts, config.decode_steps, next(run_ids))
                if repeat:  # the first round warms every path up
                    times[name].append(result)
        tokens = (batch * config.prompt_tokens, batch * config.decode_steps)
        for name, results in times.items():
            pre, dec = [r[0] for r in results], [r[1] for r in results]
            best = (tokens[0] / min(pre), tokens[1] / min(dec))
            out[name][batch] = Rates(*best, tokens[0] / median(pre), tokens[1] / median(dec))
    return out


# ----------------------------------------------------------------------------------------- report
PATHS = ("grpc", "grpc_pipelined", "in_process", "transformers")


def _row(batch: int, rates: dict[str, dict[int, Rates]]) -> dict[str, Any]:
    r = {path: rates[path][batch] for path in PATHS}
    row: dict[str, Any] = {"batch": batch}
    row.update(
        {
            path: {
                "prefill_tok_s": v.prefill,
                "decode_tok_s": v.decode,
                "prefill_tok_s_median": v.prefill_median,
                "decode_tok_s_median": v.decode_median,
            }
            for path, v in r.items()
        }
    )
    p, c = r["in_process"], r["transformers"]
    for path in ("grpc", "grpc_pipelined"):
        a = r[path]
        row[f"{path}_over_in_process"] = {"prefill": a.prefill / p.prefill, "decode": a.decode / p.decode}
        row[f"{path}_over_in_process_median"] = {
            "prefill": a.prefill_median / p.prefill_median,
            "decode": a.decode_median / p.decode_median,
        }
    row["in_process_over_transformers"] = {"prefill": p.prefill / c.prefill, "decode": p.decode / c.decode}
    row["in_process_over_transformers_median"] = {
        "prefill": p.prefill_median / c.prefill_median,
        "decode": p.decode_median / c.decode_median,
    }
    return row


def _min_ratio(
    config: BenchReplicaConfig, rates: dict[str, dict[int, Rates]], path: str, medians: bool = False
) -> float:
    def pair(r: Rates) -> tuple[float, float]:
        return (r.prefill_median, r.decode_median) if medians else (r.prefill, r.decode)

    proc = rates["in_process"]
    return min(
        min(pair(rates[path][b])[i] / pair(proc[b])[i] for i in (0, 1)) for b in config.batch_sizes
    )


def _report(
    config: BenchReplicaConfig, rates: dict[str, dict[int, Rates]], cores: Cores | None = None
) -> dict[str, Any]:
    largest = max(config.batch_sizes)
    return {
        "config": {
            "prompt_tokens": config.prompt_tokens,
            "decode_steps": config.decode_steps,
            "repeats": config.repeats,
            "block_size": config.block_size,
            "torch_threads": config.torch_threads,
            "grpc_frontend": config.grpc_frontend,
            "prefill_rounds": config.prefill_rounds,
            "grpc": "one PrefillV2 / DecodeV2 at a time",
            "grpc_pipelined": "PrefillV2 / DecodeV2 pipelined as the router's loops drive them",
            "prefill_depth": PREFILL_DEPTH,
            "decode_depth": PIPELINE_DEPTH,
            "placement": cores.describe() if cores is not None else None,
        },
        "results": [_row(b, rates) for b in config.batch_sizes],
        "goals": {
            # (a) is the replica over gRPC as the router drives it (pipelined); sequential for reference
            "grpc_over_in_process_min": _min_ratio(config, rates, "grpc_pipelined"),
            "grpc_over_in_process_min_of_medians": _min_ratio(config, rates, "grpc_pipelined", medians=True),
            "grpc_sequential_over_in_process_min": _min_ratio(config, rates, "grpc"),
            "grpc_over_in_process_goal": 0.8,
            "in_process_over_transformers_decode_at_largest_batch": rates["in_process"][largest].decode
            / rates["transformers"][largest].decode,
            # (c)'s decode time is the difference of two generate runs, so its best of a few runs
            # picks up the luckiest difference: the median run is the steadier comparison
            "in_process_over_transformers_decode_at_largest_batch_median": rates["in_process"][
                largest
            ].decode_median
            / rates["transformers"][largest].decode_median,
            "in_process_over_transformers_goal": 1.0,
        },
    }


def _print(report: dict[str, Any]) -> None:
    print(f"{'batch':>5} {'path':<15} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for row in report["results"]:
        for path in PATHS:
            r = row[path]
            print(f"{row['batch']:>5} {path:<15} {r['prefill_tok_s']:>14.0f} {r['decode_tok_s']:>13.0f}")
        a, q, b = row["grpc_over_in_process"], row["grpc_pipelined_over_in_process"], row[
            "in_process_over_transformers"
        ]
        m, t = row["grpc_pipelined_over_in_process_median"], row["in_process_over_transformers_median"]
        print(
            f"      (a)/(b) one at a time: prefill {a['prefill']:.2f} decode {a['decode']:.2f}; pipelined: "
            f"prefill {q['prefill']:.2f} decode {q['decode']:.2f}; (b)/(c) prefill {b['prefill']:.2f} "
            f"decode {b['decode']:.2f}"
        )
        print(
            f"      medians: pipelined (a)/(b) prefill {m['prefill']:.2f} decode {m['decode']:.2f}; "
            f"(b)/(c) prefill {t['prefill']:.2f} decode {t['decode']:.2f}"
        )


def run(config: BenchReplicaConfig) -> int:
    """Run the three paths and print / write the report."""
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    with tempfile.TemporaryDirectory(prefix="bench-replica-") as tmp:
        model = config.model
        if model is None:
            from pdcluster.tools.tiny_model import TinyModelConfig, make_tiny_model

            model = make_tiny_model(TinyModelConfig(out=Path(tmp) / "tiny", arch="llama"))
        import grpc

        from protos import generate_pb2_grpc as pb_grpc
        from replica.model.config import ModelConfig
        from replica.placement import set_process_cpus

        vocab = ModelConfig.from_dir(model).vocab_size
        allowed = os.sched_getaffinity(0)
        cores = Cores.plan(config.pin, allowed)
        try:
            with _replica(config, model, cores) as replica, grpc.insecure_channel(replica.address) as channel:
                stub = pb_grpc.TextGenerationServiceStub(channel)
                paths: dict[str, Runner] = {
                    "grpc": partial(_grpc_run, stub, config.prefill_rounds, 1, 1),
                    "grpc_pipelined": partial(
                        _grpc_run, stub, config.prefill_rounds, PREFILL_DEPTH, PIPELINE_DEPTH
                    ),
                    "in_process": in_process_path(config, model),
                    "transformers": transformers_path(model),
                }
                if cores is not None:
                    on = {"grpc": cores.client, "grpc_pipelined": cores.client}
                    paths = {name: _on_cores(on.get(name, cores.engine), run) for name, run in paths.items()}
                rates = measure(config, paths, vocab)
        finally:
            set_process_cpus(allowed)
    report = _report(config, rates, cores)
    _print(report)
    if config.json is not None:
        config.json.parent.mkdir(parents=True, exist_ok=True)
        config.json.write_text(json.dumps(report, indent=2))
    return 0
