"""Protobuf <-> engine dataclasses. With `rpcs.py`, the only place that touches `generate_pb2`.

Proto3 scalars cannot be absent, so zeros that make no sense as values mean "unset" here:
temperature 0 → 1.0, top_p / typical_p 0 → 1.0, repetition_penalty 0 → 1.0, truncate 0 → none, and
seed 0 when sampling → a random seed drawn here (reported back in `GeneratedText.seed`).
Negative or NaN values pass through so validation can refuse them with a clear message.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from protos import generate_pb2 as pb
from replica.engine.types import (
    BatchId,
    BatchSpec,
    CachedBatchInfo,
    DecodeInput,
    EngineInfo,
    Generation,
    GrammarKind,
    GrammarSpec,
    RequestId,
    RequestSpec,
    SamplingParams,
    StepResult,
    StoppingParams,
    TokenList,
    WarmupSpec,
)
from replica.errors import InvalidArgument


def _or_default(value: float, default: float) -> float:
    return default if value == 0 else value


def sampling_from_pb(msg: pb.NextTokenChooserParameters) -> SamplingParams:
    """Sampling parameters (proto zeros → neutral values)."""
    return SamplingParams(
        do_sample=msg.do_sample,
        temperature=_or_default(msg.temperature, 1.0),
        top_k=msg.top_k,
        top_p=_or_default(msg.top_p, 1.0),
        typical_p=_or_default(msg.typical_p, 1.0),
        seed=msg.seed or (secrets.randbits(64) if msg.do_sample else 0),
        repetition_penalty=_or_default(msg.repetition_penalty, 1.0),
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else 0.0,
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else 0.0,
        watermark=msg.watermark,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )


def request_from_pb(msg: pb.Request) -> RequestSpec:
    """One request of a new batch."""
    stopping = msg.stopping_parameters
    return RequestSpec(
        id=RequestId(msg.id),
        input_tokens=tuple(msg.input_tokens),
        inputs=msg.inputs,
        truncate=msg.truncate if msg.HasField("truncate") and msg.truncate > 0 else None,
        sampling=sampling_from_pb(msg.parameters) if msg.HasField("parameters") else SamplingParams(),
        stopping=StoppingParams(
            max_new_tokens=stopping.max_new_tokens,
            stop_sequences=tuple(stopping.stop_sequences),
            ignore_eos=stopping.ignore_eos_token,
            min_new_tokens=stopping.min_new_tokens,
        ),
        prefill_logprobs=msg.prefill_logprobs,
        top_n_tokens=msg.top_n_tokens,
        generated_prefix=msg.generated_prefix,
        grammar=grammar_from_pb(msg.grammar) if msg.HasField("grammar") else None,
    )


def grammar_from_pb(msg: pb.Grammar) -> GrammarSpec:
    """A structured-output grammar; an unknown type is INVALID_ARGUMENT."""
    try:
        kind = GrammarKind(msg.type)
    except ValueError:
        raise InvalidArgument(f"grammar: unknown type {msg.type}") from None
    if kind is not GrammarKind.JSON_OBJECT and not msg.text:
        raise InvalidArgument(f"grammar: type {kind.name} needs a text")
    return GrammarSpec(kind, msg.text)


def batch_from_pb(msg: pb.Batch) -> BatchSpec:
    """A new batch (`size` / `max_tokens` are informational: the engine counts for itself)."""
    return BatchSpec(id=BatchId(msg.id), requests=tuple(request_from_pb(r) for r in msg.requests))


def cached_batch_to_pb(info: CachedBatchInfo) -> pb.CachedBatch:
    """The caller's view of a cached batch as a new message."""
    msg = pb.CachedBatch()
    fill_cached_batch(msg, info)
    return msg


def decode_inputs_from_pb(
    batches: Sequence[pb.CachedBatch], last: Sequence[pb.Tokens] = ()
) -> tuple[DecodeInput, ...]:
    """Batches to step, each with the tokens to append first (none, or one list per batch)."""
    if last and len(last) != len(batches):
        raise InvalidArgument(f"{len(last)} last_iter_tokens entries for {len(batches)} batches")
    if last:
        return tuple(DecodeInput(BatchId(b.id), tuple(t.ids)) for b, t in zip(batches, last, strict=True))
    return tuple(DecodeInput(BatchId(b.id)) for b in batches)


# Filling fields of messages in place is several times faster than building sub-messages and
# copying them: at batch 32 that is most of the gRPC path's per-step conversion cost.
def fill_tokens(msg: pb.Tokens, tokens: TokenList) -> None:
    """Write parallel token lists into `msg`."""
    msg.ids.extend(tokens.ids)
    msg.logprobs.extend(tokens.logprobs)
    msg.texts.extend(tokens.texts)
    msg.is_special.extend(tokens.is_special)


def tokens_to_pb(tokens: TokenList) -> pb.Tokens:
    """Parallel token lists as a new message."""
    msg = pb.Tokens()
    fill_tokens(msg, tokens)
    return msg


def fill_generation(msg: pb.Generation, gen: Generation) -> None:
    """Write one request's output of a step into `msg`."""
    msg.request_id = gen.request_id
    fill_tokens(msg.tokens, gen.tokens)
    _fill_rest(msg, gen)


def generation_to_pb(gen: Generation) -> pb.Generation:
    """One request's output of a step as a new message."""
    msg = pb.Generation()
    fill_generation(msg, gen)
    return msg


def fill_step(response: Any, result: StepResult) -> None:
    """Write generations and the cached batch (left unset when every request finished) into a
    response. The edge does this for every step, so it unpacks the NamedTuples (Generation,
    TokenList) instead of reading them field by field and appends a decode step's single token
    (cheaper than extend)."""
    add = response.generations.add
    for gen in result.generations:
        rid, tokens, prefill, done, tops, cached_tokens = gen
        msg = add(request_id=rid)
        ids, logprobs, texts, special = tokens
        out = msg.tokens
        if len(ids) == 1:
            out.ids.append(ids[0])
            out.logprobs.append(logprobs[0])
            out.texts.append(texts[0])
            out.is_special.append(special[0])
        else:
            fill_tokens(out, tokens)
        if prefill is not None or done is not None or tops or cached_tokens:
            _fill_rest(msg, gen)
    if result.evicted_page_hashes and hasattr(response, "evicted_page_hashes"):  # V1 responses lack it
        response.evicted_page_hashes.extend(result.evicted_page_hashes)
    batch = result.batch
    if batch is not None:
        out_batch = response.batch
        out_batch.id = batch.id
        out_batch.request_ids.extend(batch.request_ids)
        out_batch.size = len(batch.request_ids)
        out_batch.max_tokens = batch.max_tokens


def _fill_rest(msg: pb.Generation, gen: Generation) -> None:
    """The parts of a generation other than its new tokens."""
    if gen.prefill_tokens is not None:
        fill_tokens(msg.prefill_tokens, gen.prefill_tokens)
    if gen.generated_text is not None:
        done, out = gen.generated_text, msg.generated_text
        out.text = done.text
        out.generated_tokens = done.generated_tokens
        out.finish_reason = pb.FinishReason.ValueType(done.finish_reason.value)
        if done.seed is not None:
            out.seed = done.seed
    for top in gen.top_tokens:
        fill_tokens(msg.top_tokens.add(), top)
    if gen.cached_tokens:
        msg.cached_tokens = gen.cached_tokens


def fill_cached_batch(msg: pb.CachedBatch, info: CachedBatchInfo) -> None:
    """Write the caller's view of a cached batch into `msg`."""
    msg.id = info.id
    msg.request_ids.extend(info.request_ids)
    msg.size = info.size
    msg.max_tokens = info.max_tokens


def warmup_from_pb(msg: pb.WarmupRequest) -> WarmupSpec:
    """Limits the caller announces (absent = ours)."""
    return WarmupSpec(
        max_input_tokens=msg.max_input_length if msg.HasField("max_input_length") else None,
        max_prefill_tokens=msg.max_prefill_tokens if msg.HasField("max_prefill_tokens") else None,
        max_total_tokens=msg.max_total_tokens if msg.HasField("max_total_tokens") else None,
        batch=batch_from_pb(msg.batch) if msg.HasField("batch") else None,
    )


def info_to_pb(info: EngineInfo, rank: int, tp_size: int, fabric: str = "",
               weights_model: str = "", host_copies: Sequence[tuple[str, int]] = (),
               instance: str = "") -> pb.InfoResponse:
    """Info facts."""
    msg = pb.InfoResponse(
        requires_padding=False,
        dtype=info.dtype,
        device_type=info.device_type,
        speculate=0,
        model_id=info.model_id,
        num_layers=info.num_layers,
        block_size=info.block_size,
        num_blocks_total=info.num_blocks_total,
        num_blocks_free=info.num_blocks_free,
        embed_ready=info.embed_ready,
        num_layers_loaded=info.num_layers_loaded,
        lm_head_ready=info.lm_head_ready,
        rank=rank,
        tp_size=tp_size,
        num_cached_batches=info.num_cached_batches,
        max_input_tokens=info.max_input_tokens,
        max_total_tokens=info.max_total_tokens,
        device=info.device,
        gpu_name=info.gpu_name,
        attention_backend=info.attention_backend,
        cuda_graphs=info.cuda_graphs,
        fabric=fabric,
        weights_model=weights_model,
        host_copies=[pb.HostCopy(model=name, bytes=nbytes) for name, nbytes in host_copies],
        prefix_cache=info.prefix_cache,
        num_blocks_cached=info.num_blocks_cached,
        cached_page_hashes=info.cached_page_hashes,
        instance=instance,
    )
    if info.window_size is not None:
        msg.window_size = info.window_size
    return msg
