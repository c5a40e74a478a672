"""`PromptFeeder`: the forwards that compute a batch's prompts before its final, sampling forward.

Three kinds of work come before the forward whose logits choose the first tokens:
- in-batch leaders: a request whose full pages later requests of its batch share (`shared_upto`)
  computes them first;
- chunked prefill: prompt tokens `budget` at a time until what is left fits one forward; every
  request keeps its last token for the final forward, and a request asking for prompt
  log-probabilities is never chunked (they come from the final forward's logits);
- a call-sized step of either (`advance`): one forward of at most `budget` tokens per call, so that
  a caller can interleave a long prompt's chunks with other work (a colocated replica's decode
  steps between `PrefillChunk` calls).

Each forward writes its tokens' K/V into the requests' pages and attends to the pages earlier
forwards (or the prefix cache) wrote, exactly as a resumed prompt does; its logits are not used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from replica.engine.backend import SeqInput
from replica.engine.batch import RequestState


class PromptFeeder:
    """Runs the pre-sampling forwards of prompts through `forward`, naming full pages by `register`."""

    def __init__(
        self, forward: Callable[[list[SeqInput]], Any], register: Callable[[RequestState], None]
    ) -> None:
        self._forward = forward
        self._register = register

    def leaders(self, requests: Sequence[RequestState], budget: int) -> int:
        """Compute every leader's shared pages, `budget` tokens a forward; the nanoseconds spent."""
        start = time.perf_counter_ns()
        while self.some(requests, budget, _leader_work):
            pass
        return time.perf_counter_ns() - start

    def chunks(self, requests: Sequence[RequestState], budget: int) -> int:
        """Chunk the prompts until what is left fits one forward of `budget`; the nanoseconds spent."""
        if budget <= 0:
            return 0
        start = time.perf_counter_ns()
        chunked = _chunkable(requests)
        while sum([len(r.pending) for r in requests]) > budget:
            if not self.some(chunked, budget, _chunk_work):
                break
        return time.perf_counter_ns() - start

    def advance(self, requests: Sequence[RequestState], budget: int) -> bool:
        """At most one forward of `budget` tokens (leaders first, then chunks); True when only the
        final forward is left and it fits `budget` (or nothing can be chunked further)."""
        if self.some(requests, budget, _leader_work):
            return False
        if sum([len(r.pending) for r in requests]) <= budget:
            return True
        return not self.some(_chunkable(requests), budget, _chunk_work)

    def some(
        self, requests: Sequence[RequestState], budget: int, wanted: Callable[[RequestState], int]
    ) -> bool:
        """One forward of each request's next `wanted(request)` prompt tokens, `budget` in all (in
        order; their logits unused), their full pages named; False when there was nothing to feed."""
        left, inputs, fed = budget, [], []
        for request in requests:
            take = min(wanted(request), left)
            if take <= 0:
                continue
            first = request.num_cached
            inputs.append(SeqInput(request.tokens[first : first + take], request.pages, first))
            fed.append((request, take))
            left -= take
            if not left:
                break
        if not inputs:
            return False
        self._forward(inputs)
        for request, take in fed:
            request.num_cached += take
            self._register(request)
        return True


def _leader_work(request: RequestState) -> int:
    return request.shared_upto - request.num_cached


def _chunk_work(request: RequestState) -> int:
    return len(request.pending) - 1


def _chunkable(requests: Sequence[RequestState]) -> list[RequestState]:
    return [r for r in requests if not r.spec.prefill_logprobs]
