"""`pdcluster bench serving`: end-to-end serving benchmark through the OpenAI API, vLLM's metric names.

```
 workload (Poisson at --rate, or --trace) ──► client (uvloop + httptools)          ──► router (--url,
        │                                     streamed /v1/completions, token-id prompts or `pdcluster up`)
        ▼
 OUT.jsonl (one line per request) + OUT (summary: throughput, TTFT/TPOT/ITL/E2EL, goodput)
        + the replica engine in-process at the same batch size: cluster decode tokens/s ÷ in-process
```
With `--engine simulated` the local cluster's replicas behave like `--gpu` running `--model-card`
(`pdcluster up --engine simulated`; `--model` lends its tokenizer only) and the in-process comparison
is skipped: it measures the torch engine, which a simulated cluster does not run.

The goal's ratio (`decode_ratio`), for a burst (`--rate inf`): the cluster's decode tokens/s while
every request is in a decode batch (from the last request's first decoded token to the first
finish, `stats.steady_decode_rate`) over the engine in-process decoding a batch of all
of them. `decode_ratio_whole_span` divides the decode tokens from the first first-token to the
last finish instead, which also counts later batches' prefills and migrations while earlier ones
decode; with paced arrivals (no such window) that is the ratio, against the mean concurrency.

Prompts are random token ids (exact input lengths, no tokenizer round trip); outputs are exactly
`--output-len` tokens (greedy, `ignore_eos`). Each streamed chunk carries one token (the request
asks for `logprobs: 0`, so even tokens without text arrive as a chunk): ITL is per token.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdcluster.bench.serving.compare import report, run_variants
from pdcluster.bench.serving.long_prompt import (
    LONG_KEYS,
    LONG_RUNS,
    long_prompt_ratios,
    regular_summary,
    with_long_prompt,
)
from pdcluster.bench.serving.prompts import PromptMaker, with_prefix
from pdcluster.bench.serving.sender import Served, model_vocab_size, probe, send_all
from pdcluster.bench.serving.stats import (
    RequestRecord,
    cluster_decode_rate,
    mean_concurrency,
    parse_slos,
    steady_decode_rate,
    summarize,
)
from pdcluster.bench.serving.workload import (
    Arrival,
    clip,
    conversation_arrivals,
    load_trace,
    poisson_arrivals,
)
from pdcluster.cluster.engine import ENGINES, EngineSpec
from pdcluster.cluster.local import LocalCluster, UpConfig
from pdcluster.cluster.placement import Placement

DECODE_GOAL = 0.80  # cluster decode tokens/s ÷ in-process, the goal
SIMULATED_NOTE = ("skipped: the replicas are simulated GPUs (--engine simulated), the in-process run "
                  "measures the torch engine")


@dataclass
class BenchServingConfig:
    """Options of `pdcluster bench serving`."""

    url: str = field(default="", metadata={"help": "router base URL; empty: start `pdcluster up` on --model"})
    model: Path | None = field(
        default=None, metadata={"help": "checkpoint folder (local cluster, in-process engine run)"}
    )
    num: int = field(default=64, metadata={"help": "number of requests"})
    rate: float = field(default=math.inf, metadata={"help": "requests/s, Poisson arrivals; inf: all at once"})
    input_len: int = field(default=128, metadata={"help": "prompt tokens per request"})
    output_len: int = field(default=64, metadata={"help": "generated tokens per request"})
    strategy: str = field(
        default="", metadata={"help": "migration strategy of the local cluster (pdcluster up)"}
    )
    prefill: int = field(default=1, metadata={"help": "prefill replicas of the local cluster"})
    decode: int = field(default=1, metadata={"help": "decode replicas of the local cluster"})
    torch_threads: int = field(
        default=0,
        metadata={"help": "torch threads per replica and for the in-process run; 0: cores ÷ replicas"},
    )
    num_blocks: int = field(
        default=0, metadata={"help": "KV pages per replica of the local cluster (0: its default)"}
    )
    trace: Path | None = field(
        default=None,
        metadata={"help": "replay arrivals and lengths of a Mooncake .jsonl, Azure or BurstGPT .csv trace"},
    )
    trace_speed: float = field(default=1.0, metadata={"help": "trace time compression (2 = twice as fast)"})
    slo: list[str] = field(
        default_factory=list, metadata={"help": "goodput SLOs, e.g. ttft:500 tpot:50 (ms)"}
    )
    json: Path | None = field(
        default=None, metadata={"help": "summary JSON file; per-request lines go to .jsonl"}
    )
    in_process: bool = field(default=True, metadata={
        "help": "also run the replica engine in-process (not with --engine simulated)"})
    engine: str = field(default="torch", metadata={
        "help": "local cluster: torch runs --model; simulated: replicas behave like --gpu running "
                "--model-card (replica/engine/sim/README.md; --model lends its tokenizer only)",
        "choices": list(ENGINES)})
    gpu: str = field(default="a100-80g", metadata={"help": "simulated GPU (replica/engine/sim/gpus.py)"})
    model_card: str = field(default="llama-2-7b", metadata={
        "help": "simulated model: a built-in card (replica/engine/sim/cards.py) or a config.json file"})
    byte_scale: str = field(default="1/256", metadata={
        "help": "simulated weights, KV pages and link rates are the card's and the flags' times this"})
    profile: Path | None = field(default=None, metadata={
        "help": "simulated step times from this profile table (replica/engine/sim/profile.py)"})
    pin_decode: bool = field(default=True, metadata={"help": (
        "local cluster, with more cores than decode replicas: each decode replica's engine thread on a "
        "core of its own, as on its own device (`pdcluster up --pin-decode`), everything else (router, "
        "prefill replica, the decode replicas' gRPC fronts, this load generator) on the other cores; the "
        "in-process run on the first decode core")})
    seed: int = field(default=0, metadata={"help": "seed of arrivals and prompts"})
    shared_prefix_len: int = field(default=0, metadata={"help": (
        "a shared-system-prompt load: every prompt starts with the same this many tokens")})
    conversation_turns: int = field(default=0, metadata={"help": (
        "a multi-turn chat load: conversations of this many turns, turn t's prompt the conversation "
        "so far plus --input-len new tokens ((t + 1) × --input-len); every first turn is sent, then "
        "every second, ... (0: independent prompts)")})
    routing: str = field(default="cache-aware", metadata={"choices": ["cache-aware", "load"], "help": (
        "local cluster: the router's --routing")})
    prefix_cache: bool = field(default=True, metadata={"help": (
        "local cluster: the replicas' automatic prefix caching")})
    compare_prefix_cache: bool = field(default=False, metadata={"help": (
        "local cluster: run the workload three times, on a fresh cluster each: cache-aware routing, "
        "load routing, and cache-aware with --no-prefix-cache; report each (prefix hit rate, TTFT, "
        "prefill tokens computed, KV bytes migrated) and the cache-aware run's ratios to the others")})
    long_prompt_len: int = field(default=0, metadata={"help": (
        "one more request with a prompt of this many tokens, sent when half of the others have been; "
        "the summary's regular_* figures leave it out (pdcluster/bench/serving/long_prompt.py)")})
    compare_long_prompt: bool = field(default=False, metadata={"help": (
        "local cluster: run the workload three times, on a fresh cluster each: without the long prompt, "
        "with it, and with it and the router's --no-chunked-prefill; report the other requests' TPOT "
        "and ITL P99 against the run without it")})
    router_flag: list[str] = field(default_factory=list, metadata={"help": (
        "local cluster: more router flags, NAME=VALUE each (`pdcluster up --router-flag`), e.g. "
        "max-batch-prefill-tokens=256")})
    chunked_prefill: bool = field(default=True, metadata={"help": (
        "local cluster: the router's --chunked-prefill (colocated: a long prompt a chunk per step)")})
    max_model_len: int = field(default=0, metadata={"help": (
        "--url: context length when the server tells none (it has no /info and no max_model_len)")})
    vocab_size: int = field(default=0, metadata={"help": (
        "--url: vocabulary size when the server has no /info and no --model is given (prompts are "
        "token ids below it)")})
    request_timeout: float = field(default=600.0, metadata={"help": "seconds one request may take"})
    startup_timeout: float = field(
        default=180.0, metadata={"help": "seconds the local cluster may take to start"}
    )

    def __post_init__(self) -> None:
        if not self.url and self.model is None:
            raise ValueError("give --url of a running router or --model to start a local cluster")
        if self.num < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("--num, --input-len and --output-len must be >= 1")
        if not self.rate > 0:
            raise ValueError("--rate must be > 0 (inf: all at once)")
        parse_slos(self.slo)
        if self.engine_spec.simulated and self.url:
            raise ValueError("--engine simulated starts a local cluster: give --model, not --url")
        if self.shared_prefix_len < 0 or self.conversation_turns < 0:
            raise ValueError("--shared-prefix-len and --conversation-turns must be >= 0")
        if self.conversation_turns and self.trace is not None:
            raise ValueError("--conversation-turns makes its own load: not with --trace")
        if self.compare_prefix_cache and self.url:
            raise ValueError("--compare-prefix-cache starts local clusters: give --model, not --url")
        if self.long_prompt_len < 0 or (self.compare_long_prompt and self.long_prompt_len <= self.input_len):
            raise ValueError("--long-prompt-len must be >= 0, and longer than --input-len to compare")
        if self.compare_long_prompt and (self.url or self.compare_prefix_cache):
            raise ValueError("--compare-long-prompt starts local clusters of its own: give --model, "
                             "not --url or --compare-prefix-cache")

    @property
    def engine_spec(self) -> EngineSpec:
        """The local cluster's engine (ValueError naming the known GPUs or cards on a bad one)."""
        return EngineSpec(self.engine, self.gpu, self.model_card, self.byte_scale,
                          Path(self.profile) if self.profile is not None else None)


def run(config: BenchServingConfig) -> int:
    """CLI runner: benchmark, print and write the summary."""
    if config.compare_prefix_cache:
        return run_prefix_comparison(config)
    if config.compare_long_prompt:
        return run_long_prompt_comparison(config)
    summary = measure(config)
    _print(summary)
    return 0 if summary["failed"] == 0 else 1


def measure(config: BenchServingConfig) -> dict[str, Any]:
    """One benchmark run (a local cluster started and stopped when no --url); its summary, written
    to --json with the per-request lines."""
    # SIGTERM unwinds like Ctrl-C, so a local cluster this started is stopped too.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    placement = placement_of(config)
    cores = os.sched_getaffinity(0)
    try:
        if config.url:
            summary = _run_client(config, config.url.rstrip("/"))
        else:
            cluster = local_cluster(config)
            print(f"bench serving: local cluster starting, logs in {cluster.log_dir}", file=sys.stderr,
                  flush=True)
            with cluster:
                if placement is not None:  # the load generator stays off the decode replicas' cores
                    os.sched_setaffinity(0, placement.shared)
                summary = _run_client(config, cluster.http_url)
        summary["placement"] = placement.describe() if placement else None
        records = summary.pop("_records")
        if config.in_process and config.engine_spec.simulated:
            summary["in_process"] = SIMULATED_NOTE
        elif config.in_process and config.model is not None:
            # pinned: the engine alone on the core the decode replica had, the same one core
            os.sched_setaffinity(0, placement.decode[0] if placement else cores)
            summary.update(_compare_in_process(config, records, summary["duration"]))
    finally:
        os.sched_setaffinity(0, cores)
    _write(config, summary, records)
    return summary


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


# ------------------------------------------------------------------------------------ the client
def _run_client(config: BenchServingConfig, url: str) -> dict[str, Any]:
    """The load generator on uvloop: its event loop costs less CPU per token, CPU the cluster needs."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_bench(config, url))


async def _bench(config: BenchServingConfig, url: str) -> dict[str, Any]:
    served = probe(url, config.max_model_len, config.vocab_size or model_vocab_size(config.model))
    arrivals = _workload(config, served)
    maker = (PromptMaker(config.seed, served.vocab_size, block_tokens=config.input_len)
             if config.conversation_turns else PromptMaker(config.seed, served.vocab_size))
    prompts = maker.prompts(arrivals)
    if config.shared_prefix_len:
        prompts = with_prefix(prompts, maker.system_prompt(config.shared_prefix_len))
    records, duration, _ = await send_all(url, served.model_id, arrivals, prompts, config.request_timeout,
                                          _progress())
    summary = summarize(records, duration, parse_slos(config.slo))
    summary.update(regular_summary(records, len(arrivals) - 1 if config.long_prompt_len else -1))
    summary.update(
        {
            "url": url,
            "model_id": served.model_id,
            "num": config.num,
            "rate": config.rate if math.isfinite(config.rate) else "inf",
            "input_len": config.input_len,
            "output_len": config.output_len,
            "trace": str(config.trace) if config.trace else None,
            "strategy": config.strategy or None,
            "shared_prefix_len": config.shared_prefix_len,
            "conversation_turns": config.conversation_turns,
            "long_prompt_len": config.long_prompt_len,
            "chunked_prefill": None if config.url else config.chunked_prefill,
            "routing": None if config.url else config.routing,
            "prefix_cache": None if config.url else config.prefix_cache,
            "engine": _engine_label(config.engine_spec),
            "_records": records,
        }
    )
    return summary


def _engine_label(engine: EngineSpec) -> str:
    if not engine.simulated:
        return engine.kind
    return f"simulated:{engine.gpu}:{engine.model_card}:{engine.byte_scale}"


def _workload(config: BenchServingConfig, served: Served) -> list[Arrival]:
    if config.trace is not None:
        arrivals = load_trace(config.trace, config.num, config.trace_speed)
    elif config.conversation_turns:
        arrivals = conversation_arrivals(config.num, config.rate, config.conversation_turns,
                                         config.input_len, config.output_len, config.seed)
    else:
        arrivals = poisson_arrivals(config.num, config.rate, config.input_len, config.output_len, config.seed)
    if config.long_prompt_len:
        arrivals = with_long_prompt(arrivals, config.long_prompt_len, config.output_len)
    return clip(arrivals, served.max_input_tokens, served.max_total_tokens)


def _progress(every: float = 10.0) -> Callable[[list[asyncio.Task[RequestRecord]]], None]:
    """A line on stderr every `every` seconds, so a slow or stuck run is visible."""
    last = [0.0]

    def report(tasks: list[asyncio.Task[RequestRecord]]) -> None:
        last[0] += 1.0
        if last[0] < every:
            return
        last[0] = 0.0
        done = [t.result() for t in tasks if t.done()]
        failed = sum(not r.success for r in done)
        print(f"bench serving: {len(done)}/{len(tasks)} done, {failed} failed", file=sys.stderr, flush=True)

    return report


# ------------------------------------------------------------------------- in-process comparison
def _compare_in_process(config: BenchServingConfig, records: list[RequestRecord], duration: float) -> dict:
    """The engine alone at the batch size the cluster ran (all requests, or the mean concurrency)."""
    from pdcluster.bench.engine_baseline import run_engine_baseline

    assert config.model is not None
    done = [r for r in records if r.success]
    if not done:
        return {}
    if math.isinf(config.rate) and config.trace is None:
        batch = len(done)
    else:
        batch = max(1, round(mean_concurrency(records, duration)))
    input_len = round(sum(r.input_len for r in done) / len(done))
    output_len = max(2, round(sum(r.output_len for r in done) / len(done)))
    threads = threads_per_replica(config)
    baseline = run_engine_baseline(
        config.model, batch, input_len, output_len, seed=config.seed, threads=threads
    )
    def over_in_process(rate: float) -> float:
        return rate / baseline.decode_tokens_per_s if baseline.decode_tokens_per_s else 0.0

    cluster = cluster_decode_rate(records)
    steady = steady_decode_rate(records)
    # The goal compares the same batch size: with a burst (rate inf), the cluster while it decodes
    # every request at once (steady) against the engine decoding that batch; the whole-span figure
    # adds the ramp (later batches' prefills and migrations) and the tail. Paced arrivals have no
    # such window: their ratio is the whole span's against the mean concurrency.
    capacity = math.isinf(config.rate) and config.trace is None
    steady_basis = capacity and steady.seconds > 0
    ratio = over_in_process(steady.tokens_per_s if steady_basis else cluster)
    return {
        "in_process_batch_size": batch,
        "in_process_torch_threads": threads,
        "in_process_decode_tokens_per_s": baseline.decode_tokens_per_s,
        "in_process_prefill_tokens_per_s": baseline.prefill_tokens_per_s,
        "cluster_steady_decode_tokens_per_s": steady.tokens_per_s,
        "steady_window_s": steady.seconds,
        "steady_window_tokens": steady.tokens,
        "cluster_decode_tokens_per_s": cluster,
        "decode_ratio": ratio,
        "decode_ratio_whole_span": over_in_process(cluster),
        "decode_ratio_basis": "steady" if steady_basis else "whole_span",
        "decode_ratio_goal": DECODE_GOAL,
        "decode_ratio_goal_met": ratio >= DECODE_GOAL,
        # With paced arrivals the cluster decodes what is offered, not what it could: compare at rate inf.
        "decode_ratio_is_capacity": capacity,
    }


# --------------------------------------------------------------------------------- local cluster
def placement_of(config: BenchServingConfig) -> Placement | None:
    """Cores of the local cluster's processes when pinned (not with --url, nor without a spare core)."""
    if (not config.pin_decode or config.url or config.engine_spec.simulated
            or len(os.sched_getaffinity(0)) <= config.decode):
        return None  # a simulated replica sleeps its step times: no core of its own to pin
    return Placement.plan(config.decode)


def threads_per_replica(config: BenchServingConfig) -> int:
    """Torch threads of one replica: as given, else this machine's cores shared by the replicas."""
    if config.torch_threads:
        return config.torch_threads
    if placement_of(config) is not None:
        return 1  # a pinned decode replica has one core
    return max(1, (os.cpu_count() or 1) // max(1, config.prefill + config.decode))


def local_cluster(config: BenchServingConfig) -> LocalCluster:
    """`pdcluster up`'s cluster on --model for this run: free ports, logs in a temp folder."""
    return LocalCluster(up_config(config))


def up_config(config: BenchServingConfig) -> UpConfig:
    """The `pdcluster up` options of this run's local cluster."""
    assert config.model is not None
    up = UpConfig(
        model=config.model, prefill=config.prefill, decode=config.decode, http_port=0, admin_port=0,
        torch_threads=threads_per_replica(config), pin_decode=placement_of(config) is not None,
        ready_timeout=config.startup_timeout, engine=config.engine, gpu=config.gpu,
        model_card=config.model_card, byte_scale=config.byte_scale, profile=config.profile,
    )
    up.routing, up.prefix_cache = config.routing, config.prefix_cache
    up.router_flag = [*config.router_flag, *([] if config.chunked_prefill else ["chunked-prefill=false"])]
    if config.strategy:
        up.strategy = config.strategy
    if config.num_blocks:
        up.num_blocks = config.num_blocks
    return up


# ------------------------------------------------------------------------- prefix-cache comparison
PREFIX_RUNS = {  # name: (routing, prefix cache)
    "cache_aware": ("cache-aware", True),
    "load": ("load", True),
    "no_prefix_cache": ("cache-aware", False),
}
PREFIX_KEYS = ("completed", "failed", "duration", "prefix_hit_rate", "cached_prompt_tokens",
               "prefill_tokens_computed", "kv_bytes_migrated", "median_ttft_ms", "p99_ttft_ms",
               "median_tpot_ms", "p99_tpot_ms", "request_throughput")


def run_prefix_comparison(config: BenchServingConfig) -> int:
    """The same workload on three fresh local clusters (`PREFIX_RUNS`), one after the other; the
    summary holds each run's and the cache-aware run's ratios to the other two."""
    variants = {name: {"compare_prefix_cache": False, "in_process": False, "routing": routing,
                       "prefix_cache": cache} for name, (routing, cache) in PREFIX_RUNS.items()}
    runs = run_variants(config, variants, measure, config.json)
    return report("prefix cache comparison", runs, PREFIX_KEYS, prefix_ratios(runs), config.json)


def prefix_ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The cache-aware run against each other run: the share of prefill tokens it did not compute,
    and its TTFT P50 / P99 speed-up (theirs ÷ its; 0 when a figure is missing or zero)."""
    mine = runs["cache_aware"]
    out: dict[str, float] = {}

    def over(a: float, b: float) -> float:
        return a / b if b else 0.0

    for other in ("load", "no_prefix_cache"):
        theirs = runs[other]
        out[f"prefill_tokens_saved_vs_{other}"] = 1.0 - over(mine["prefill_tokens_computed"],
                                                            theirs["prefill_tokens_computed"])
        out[f"ttft_p50_speedup_vs_{other}"] = over(theirs["median_ttft_ms"], mine["median_ttft_ms"])
        out[f"ttft_p99_speedup_vs_{other}"] = over(theirs["p99_ttft_ms"], mine["p99_ttft_ms"])
    return out


# -------------------------------------------------------------------------- long-prompt comparison
def run_long_prompt_comparison(config: BenchServingConfig) -> int:
    """The workload on three fresh local clusters (`long_prompt.LONG_RUNS`); print and write it."""
    variants = {name: {"compare_long_prompt": False, "in_process": False, "chunked_prefill": chunked,
                       "long_prompt_len": config.long_prompt_len if long else 0}
                for name, (long, chunked) in LONG_RUNS.items()}
    runs = run_variants(config, variants, measure, config.json)
    return report("long prompt comparison", runs, LONG_KEYS, long_prompt_ratios(runs), config.json)


# -------------------------------------------------------------------------------------- output
def _write(config: BenchServingConfig, summary: dict[str, Any], records: list[RequestRecord]) -> None:
    if config.json is None:
        return
    config.json.parent.mkdir(parents=True, exist_ok=True)
    lines = config.json.with_suffix(".jsonl")
    lines.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    summary = {**summary, "per_request_file": str(lines)}
    config.json.write_text(json.dumps(summary, indent=2, default=str, allow_nan=False) + "\n")


def _print(summary: dict[str, Any]) -> None:
    keys = [
        "completed",
        "failed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
    ]
    keys += [k for k in summary if k.endswith("_ms") and k.split("_")[0] in ("mean", "median", "p99")]
    keys += [
        k
        for k in (
            "request_goodput",
            "prefix_hit_rate",
            "prefill_tokens_computed",
            "kv_bytes_migrated",
            "cluster_steady_decode_tokens_per_s",
            "steady_window_s",
            "cluster_decode_tokens_per_s",
            "in_process_decode_tokens_per_s",
            "in_process_batch_size",
            "decode_ratio",
            "decode_ratio_whole_span",
            "in_process",
        )
        if k in summary
    ]
    print("=" * 20, "serving benchmark", "=" * 20)
    for key in keys:
        value = summary[key]
        print(f"{key:<36} {value:.3f}" if isinstance(value, float) else f"{key:<36} {value}")
