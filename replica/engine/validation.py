"""Admission checks of a new batch: everything is refused before a single page is allocated.

Pure Python. Caller mistakes are INVALID_ARGUMENT; prompts over the limits are RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replica.config import ReplicaConfig
from replica.engine.types import BatchSpec, RequestSpec, SamplingParams
from replica.errors import InvalidArgument, ResourceExhausted
from replica.model.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What this replica accepts."""

    vocab_size: int
    max_input_tokens: int
    max_total_tokens: int
    max_prefill_tokens: int
    # a prefill's forwards feed at most this many prompt tokens (0 = one forward): longer prompts
    # run as consecutive chunks, each attending to the pages its predecessors wrote
    prefill_chunk_tokens: int = 0


def derive_limits(config: ReplicaConfig, model: ModelConfig) -> Limits:
    """Input/total/prefill limits: configured values, never past the model's positions."""
    positions = model.max_position_embeddings
    max_total = min(config.max_total_tokens or positions, positions)
    max_input = min(config.max_input_tokens or max_total - 1, max_total - 1)
    if max_input <= 0:
        raise ValueError(f"max_total_tokens {max_total} leaves no room for a prompt")
    if config.max_total_tokens and config.max_total_tokens > positions:
        log.warning("max_total_tokens %d capped at %d positions", config.max_total_tokens, positions)
    return Limits(
        vocab_size=model.vocab_size,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_prefill_tokens=max(config.max_batch_prefill_tokens, max_input),
        prefill_chunk_tokens=config.max_batch_prefill_tokens,
    )


def _finite(value: float) -> bool:
    return not math.isnan(value) and not math.isinf(value)


def check_sampling(params: SamplingParams, where: str) -> None:
    """Refuse sampling values that make no sense."""
    if not _finite(params.temperature) or params.temperature <= 0:
        raise InvalidArgument(f"{where}: temperature must be a positive number, got {params.temperature}")
    if not (0.0 < params.top_p <= 1.0):
        raise InvalidArgument(f"{where}: top_p must be in (0, 1], got {params.top_p}")
    if not (0.0 < params.typical_p <= 1.0):
        raise InvalidArgument(f"{where}: typical_p must be in (0, 1], got {params.typical_p}")
    if params.top_k < 0:
        raise InvalidArgument(f"{where}: top_k must be >= 0, got {params.top_k}")
    if not _finite(params.repetition_penalty) or params.repetition_penalty <= 0:
        raise InvalidArgument(f"{where}: repetition_penalty must be > 0, got {params.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not _finite(getattr(params, name)):
            raise InvalidArgument(f"{where}: {name} must be a finite number")
    if params.watermark:
        raise InvalidArgument(f"{where}: watermark is not supported")
    if not 0 <= params.seed < 2**64:
        raise InvalidArgument(f"{where}: seed must fit in 64 bits")


def prompt_tokens(
    spec: RequestSpec, limits: Limits, tokenize: Callable[[str], list[int]] | None
) -> list[int]:
    """The request's prompt after tokenization and truncation, checked against vocab and limits."""
    where = f"request {spec.id}"
    tokens = list(spec.input_tokens)
    if not tokens and spec.inputs:
        if tokenize is None:
            raise InvalidArgument(f"{where}: only text given and this replica has no tokenizer")
        tokens = tokenize(spec.inputs)
    if spec.truncate and len(tokens) > spec.truncate:
        tokens = tokens[-spec.truncate :]
    if not tokens:
        raise InvalidArgument(f"{where}: empty prompt")
    if spec.generated_prefix > len(tokens):
        raise InvalidArgument(
            f"{where}: generated_prefix {spec.generated_prefix} > the prompt's {len(tokens)} tokens"
        )
    bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidArgument(f"{where}: token ids {bad[:5]} outside the vocabulary of {limits.vocab_size}")
    if len(tokens) > limits.max_input_tokens:
        limit = limits.max_input_tokens
        raise ResourceExhausted(f"{where}: prompt of {len(tokens)} tokens > max_input_tokens {limit}")
    total = len(tokens) + spec.stopping.max_new_tokens
    if total > limits.max_total_tokens:
        raise ResourceExhausted(
            f"{where}: prompt {len(tokens)} + max_new_tokens {spec.stopping.max_new_tokens} > "
            f"max_total_tokens {limits.max_total_tokens}"
        )
    return tokens


def check_request(spec: RequestSpec, limits: Limits, has_tokenizer: bool) -> None:
    """Checks of one request that do not depend on its prompt."""
    where = f"request {spec.id}"
    check_sampling(spec.sampling, where)
    if spec.stopping.max_new_tokens <= 0:
        raise InvalidArgument(f"{where}: max_new_tokens must be positive")
    least, most = spec.stopping.min_new_tokens, spec.stopping.max_new_tokens
    if least > most:
        raise InvalidArgument(f"{where}: min_new_tokens {least} > max_new_tokens {most}")
    if spec.stopping.stop_sequences and not has_tokenizer:
        raise InvalidArgument(f"{where}: stop sequences need a tokenizer, this replica has none")
    if any(not s for s in spec.stopping.stop_sequences):
        raise InvalidArgument(f"{where}: empty stop sequence")
    bad_ids = [t for t, _ in spec.sampling.logit_bias if not 0 <= t < limits.vocab_size]
    if bad_ids:
        raise InvalidArgument(f"{where}: logit_bias token ids {bad_ids[:5]} outside the vocabulary")
    if not all(_finite(bias) for _, bias in spec.sampling.logit_bias):
        raise InvalidArgument(f"{where}: logit_bias values must be finite numbers")
    if spec.top_n_tokens < 0 or spec.top_n_tokens > limits.vocab_size:
        raise InvalidArgument(f"{where}: top_n_tokens must be in [0, {limits.vocab_size}]")


def admit_batch(
    spec: BatchSpec, limits: Limits, tokenize: Callable[[str], list[int]] | None
) -> list[list[int]]:
    """Every request's prompt tokens, or the first reason to refuse the batch."""
    if not spec.requests:
        raise InvalidArgument(f"batch {spec.id} has no requests")
    ids = [r.id for r in spec.requests]
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"batch {spec.id} lists a request id twice")
    prompts = []
    for request in spec.requests:
        check_request(request, limits, tokenize is not None)
        prompts.append(prompt_tokens(request, limits, tokenize))
    total = sum(len(p) for p in prompts)
    if total > limits.max_prefill_tokens:
        raise ResourceExhausted(
            f"batch {spec.id}: {total} prompt tokens > max_batch_prefill_tokens {limits.max_prefill_tokens}"
        )
    return prompts


def check_appended(tokens: Sequence[int], count: int, vocab_size: int, where: str) -> None:
    """Tokens appended by DecodeV2: one per request of the batch, all in the vocabulary."""
    if len(tokens) != count:
        raise InvalidArgument(f"{where}: {len(tokens)} last_iter_tokens for {count} requests")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{where}: token ids {bad[:5]} are outside the vocabulary of {vocab_size}")
