"""The old replica's side of a relay: PrefillV2 with NAIVE_PP|IMMIGRATE.

The batch is admitted here (pages for all layers), the activation after layer k (received from
the new replica, or the local embedding when k = 0) runs through layers k … L-1 and the head; only
those layers' K/V are written here, so the batch's KV is split: [0, k) on the new replica, [k, L)
on this one. Each layer waits for its weights with the call's deadline (normally all are loaded).
The edge's call receives the activation before this runs (off the engine thread): a batch refused
here (pages, limits) then leaves the (peer, ACTIVATION stream) channel aligned for the next relay.
"""

from __future__ import annotations

import time
from typing import Any

from replica.engine.engine import Engine
from replica.engine.types import BatchSpec, StepResult


def naive_pp_prefill(
    engine: Engine, spec: BatchSpec, start_layer: int, hidden: Any, timeout: float | None
) -> StepResult:
    """Admit `spec`, run layers [start_layer, L) and the head, choose first tokens, cache the batch."""
    start = time.perf_counter_ns()
    batch = engine.admit(spec)
    try:
        runner, readiness = engine.runner, engine.readiness
        with runner.inference():
            seqs = engine.seq_inputs(batch.requests, with_prompt_logprobs=True)
            ctx = runner.context(seqs)
            if hidden is None:
                readiness.wait_for(lambda r: r.embed, timeout, "the embedding")
                hidden = runner.embed(seqs)
            for index in range(start_layer, runner.num_layers):
                readiness.wait_layer(index, timeout)
                hidden = runner.run_layers(hidden, ctx, index, index + 1)
            readiness.wait_for(lambda r: r.head, timeout, "the lm_head")
            out = runner.logits(hidden, ctx, seqs)
    except BaseException:
        engine.blocks.free(batch.pages())
        raise
    # layers [0, start_layer) of these pages were written on the new replica, not here
    return engine.finish_prefill(batch, out, start, time.perf_counter_ns() - start, complete=start_layer == 0)
