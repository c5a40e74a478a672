"""The router's replica-call types ⇄ the replica engine's types, in one process (what the gRPC client
and the replica's edge do on the two sides of the wire, without the wire).

Proto zeros mean "unset" at the replica's edge (`replica/server/convert.py`); the router's types say
unset as None, so only a sampling request without a seed needs one here: it gets a fixed seed (the
edge would draw a random one; a simulation must repeat exactly).
"""

from __future__ import annotations

from replica.engine import types as e
from replica.errors import PEER_CAUSE, ReplicaError, Status
from router import errors as r
from router import types as t

FIXED_SEED = 0x5EED
"""The seed of a sampling request that names none."""

_REASONS = {e.FinishReason.LENGTH: t.FinishReason.LENGTH, e.FinishReason.EOS_TOKEN: t.FinishReason.EOS_TOKEN,
            e.FinishReason.STOP_SEQUENCE: t.FinishReason.STOP_SEQUENCE}

_ERRORS: dict[Status, type[r.ReplicaCallError]] = {
    Status.UNAVAILABLE: r.ReplicaUnavailable,
    Status.DEADLINE_EXCEEDED: r.ReplicaTimeout,
    Status.INVALID_ARGUMENT: r.ReplicaRejected,
    Status.RESOURCE_EXHAUSTED: r.ReplicaRejected,
    Status.FAILED_PRECONDITION: r.ReplicaRejected,
    Status.NOT_FOUND: r.ReplicaRejected,
    Status.ALREADY_EXISTS: r.ReplicaRejected,
    Status.PERMISSION_DENIED: r.ReplicaRejected,
}


def request_spec(wire: t.WireRequest) -> e.RequestSpec:
    """One request of a batch, as the replica's edge would make it."""
    req, s, st = wire.request, wire.request.sampling, wire.request.stopping
    sampling = e.SamplingParams(
        do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        typical_p=s.typical_p, seed=s.seed if s.seed is not None else (FIXED_SEED if s.do_sample else 0),
        repetition_penalty=s.repetition_penalty, frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty, logit_bias=tuple(sorted(s.logit_bias)),
    )
    return e.RequestSpec(
        id=e.RequestId(wire.id), input_tokens=req.input_ids, truncate=req.truncate or None,
        sampling=sampling, stopping=e.StoppingParams(st.max_new_tokens, st.stop_sequences, st.ignore_eos),
        prefill_logprobs=req.prefill_logprobs, top_n_tokens=req.top_n_tokens,
        generated_prefix=req.generated_prefix,
    )


def batch_spec(batch: t.BatchSpec) -> e.BatchSpec:
    """A new batch."""
    return e.BatchSpec(e.BatchId(batch.id), tuple(request_spec(w) for w in batch.requests))


def decode_inputs(batches: list[t.CachedBatch], last: list[list[int]]) -> list[e.DecodeInput]:
    """DecodeV2's batches with their appended tokens."""
    return [e.DecodeInput(e.BatchId(b.id), tuple(ids)) for b, ids in zip(batches, last, strict=True)]


def cached(info: e.CachedBatchInfo, reused_tokens: tuple[int, ...] = ()) -> t.CachedBatch:
    """A cached batch, as the router knows it (an Immigrate's: with the prompt tokens its receiver
    held already, per request)."""
    ids = tuple(t.RequestId(i) for i in info.request_ids)
    return t.CachedBatch(t.BatchId(info.id), ids, info.max_tokens, reused_tokens)


def _tokens(tokens: e.TokenList, tops: tuple[e.TokenList, ...] = ()) -> tuple[t.TokenInfo, ...]:
    if not tops:
        return tuple(map(t.TokenInfo, tokens.ids, tokens.texts, tokens.logprobs, tokens.is_special))
    out = []
    for i, tid in enumerate(tokens.ids):
        top: tuple[t.TopToken, ...] = ()
        if i < len(tops):
            o = tops[i]
            top = tuple(map(t.TopToken, o.ids, o.texts, o.logprobs, o.is_special))
        out.append(t.TokenInfo(tid, tokens.texts[i], tokens.logprobs[i], tokens.is_special[i], top))
    return tuple(out)


def generation(g: e.Generation) -> t.Generation:
    """One request's output of a step."""
    finished = None
    if g.generated_text is not None:
        done = g.generated_text
        finished = t.Finished(done.text, done.generated_tokens, _REASONS[done.finish_reason], done.seed)
    prefill = _tokens(g.prefill_tokens) if g.prefill_tokens is not None else ()
    return t.Generation(t.RequestId(g.request_id), _tokens(g.tokens, g.top_tokens), prefill, finished)


def step(result: e.StepResult) -> t.StepResult:
    """A prefill or decode step."""
    return t.StepResult(tuple(generation(g) for g in result.generations),
                        None if result.batch is None else cached(result.batch))


def info(engine: e.EngineInfo, rank: int, host_copies: tuple[tuple[str, int], ...] = ()) -> t.ReplicaInfo:
    """Info (`host_copies`: (model, bytes) of the replica's host-memory copies)."""
    return t.ReplicaInfo(
        model_id=engine.model_id, dtype=engine.dtype, num_layers=engine.num_layers,
        block_size=engine.block_size, num_blocks_total=engine.num_blocks_total,
        num_blocks_free=engine.num_blocks_free, rank=rank, max_input_tokens=engine.max_input_tokens,
        max_total_tokens=engine.max_total_tokens, num_layers_loaded=engine.num_layers_loaded,
        embed_ready=engine.embed_ready, lm_head_ready=engine.lm_head_ready,
        num_cached_batches=engine.num_cached_batches, device_type=engine.device_type,
        host_copies=host_copies,
    )


def call_error(address: str, method: str, exc: ReplicaError) -> r.ReplicaCallError:
    """The router's typed error for a replica error (as the gRPC client maps the status)."""
    cls = _ERRORS.get(exc.status, r.ReplicaInternal)
    if cls is r.ReplicaUnavailable and exc.cause == PEER_CAUSE:
        cls = r.PeerFailed
    return cls(address, method, exc.status.value, str(exc))
