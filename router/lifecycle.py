"""The request lifecycle: accepted requests by id, the queue they wait in, and how they end.

```
 submit ─► RequestQueue ─► take (a prefill loop) ─► deliver (every step's tokens) ─► finished
              ▲ requeue (its replica died: a new run)  │ retry (a replica had no pages yet)
              └────────────────────────────────────────┘ fail (an error event) / cancelled (client gone)
```
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping

from router.batches import Member
from router.metrics import RouterMetrics
from router.queue import Budgets, PlannedBatch, QueueEntry, RequestQueue, request_blocks
from router.replicas import ServingLimits
from router.requests import RequestState, RequestStream
from router.types import (
    GenerateRequest,
    ReplicaId,
    RequestId,
    RequestRejected,
    StepResult,
    TokenDecoder,
)
from router.wakeup import Wakeups


class Requests:
    """Every accepted request that has not ended, and the queue of those waiting for a prefill."""

    def __init__(self, metrics: RouterMetrics, clock: Callable[[], float], decoder: TokenDecoder,
                 wakeups: Wakeups, max_requeues: int) -> None:
        self.metrics = metrics
        self.clock = clock
        self.decoder = decoder
        self.wakeups = wakeups
        self.max_requeues = max_requeues
        self.queue = RequestQueue()
        self._states: dict[RequestId, RequestState] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._states.values()))

    def submit(self, request: GenerateRequest, serving: ServingLimits) -> RequestStream:
        """Check against the serving replicas' limits, queue, and return the request's event stream."""
        if request.truncate is not None:
            # Truncate here, as the replica would: pages, limits and re-runs then see the real prompt.
            kept = request.input_ids[-request.truncate:]
            request = dataclasses.replace(request, input_ids=kept, truncate=None)
        check_limits(request, serving)
        state = RequestState(RequestId(next(self._ids)), request, self.clock, self.decoder)
        self._states[state.id] = state
        self.queue.push(QueueEntry(state.id, request, _alive(state)))
        self._queue_gauges()
        self.wakeups.queue(len(self.queue))
        return RequestStream(state, self._closed)

    def take(self, budgets: Budgets, accept: Callable[[QueueEntry], bool] | None = None
             ) -> tuple[PlannedBatch, list[Member]] | None:
        """The next batch that fits `budgets` (of the entries `accept` takes), as members at their
        current run."""
        planned = self.queue.next_batch(budgets, accept)
        self._queue_gauges()
        if planned is None:
            return None
        states = [self._states.get(e.request_id) for e in planned.entries]
        return planned, [Member(s, s.run, e.request) for s, e in zip(states, planned.entries, strict=True)
                         if s is not None]

    def deliver(self, result: StepResult, members: Mapping[RequestId, Member]) -> None:
        """Stream one step's generations to their requests (stale runs are ignored)."""
        tokens = 0
        for gen in result.generations:
            member = members.get(gen.request_id)
            if member is None or not member.current or not member.state.alive:
                continue
            tokens += len(gen.tokens)
            if member.state.deliver(gen):
                self._finish(member.state, "finished")
        self.metrics.generated(tokens)

    def requeue(self, members: Iterable[Member], reason: str) -> None:
        """Re-run these requests from their generated tokens on another replica (front of the queue)."""
        for member in reversed(list(members)):
            state = member.state
            if not member.current or not state.alive:
                continue
            if state.requeues >= self.max_requeues:
                self.fail([member], f"request failed after {state.requeues} re-runs: {reason}", 503)
                continue
            state.requeues += 1
            state.new_run()
            self.metrics.requeue()
            self.queue.push_front(QueueEntry(state.id, state.current(), _alive(state)))
        self._queue_gauges()
        self.wakeups.queue(len(self.queue))

    def retry(self, members: Iterable[Member], reason: str) -> None:
        """A replica refused these requests' batch for want of pages: queue them again, same run
        (nothing of them ran), ahead of new ones; after `max_requeues` refusals they fail."""
        for member in reversed(list(members)):
            state = member.state
            if not member.current or not state.alive:
                continue
            if state.refusals >= self.max_requeues:
                self.fail([member], f"request refused {state.refusals + 1} times: {reason}", 502)
                continue
            state.refusals += 1
            self.queue.push_front(QueueEntry(state.id, member.request, _alive(state)))
        self._queue_gauges()
        self.wakeups.queue(len(self.queue))

    def fail(self, members: Iterable[Member], message: str, http_status: int = 500) -> None:
        """End these requests with an error event."""
        for member in members:
            if member.current and member.state.alive:
                member.state.fail(message, http_status)
                self._finish(member.state, "failed")

    def on(self, rid: ReplicaId) -> list[Member]:
        """The live runs on replica `rid`, as members."""
        return [Member.now(s) for s in self._states.values() if s.replica == rid and s.alive]

    def fail_queued(self, message: str) -> None:
        """End every queued request with 503: nothing alive could run it (new ones are refused too)."""
        for entry in self.queue.take_all():
            state = self._states.get(entry.request_id)
            if state is not None and state.alive:
                state.fail(message, 503)
                self._finish(state, "failed")
        self._queue_gauges()

    def fail_all(self, message: str) -> None:
        """End every request still running or queued with 503 (the router stops)."""
        for state in list(self._states.values()):
            state.fail(message, 503)
            self._finish(state, "failed")

    def _closed(self, state: RequestState) -> None:
        self._finish(state, "cancelled")
        # its queued run goes (a head that did not fit may be gone) and a hand-off of its batch
        # waiting for a destination may be over; a batch on a replica is pruned by that loop's next step
        if len(self.queue):
            self.wakeups.queue(len(self.queue))
        self.wakeups.moves.notify()

    def _finish(self, state: RequestState, outcome: str) -> None:
        if self._states.pop(state.id, None) is None:
            return
        end = state.finished_at or self.clock()
        self.metrics.request_done(outcome, state.submitted_at, state.first_token_at, end,
                                  len(state.original.input_ids), len(state.generated))

    def _queue_gauges(self) -> None:
        self.metrics.queue(len(self.queue), self.queue.waiting_prompt_tokens())


def check_limits(request: GenerateRequest, serving: ServingLimits) -> None:
    """Raise `RequestRejected` unless every serving replica can run `request`."""
    if not serving.replicas:
        raise RequestRejected("no replica is serving", 503)
    n, new = len(request.input_ids), request.stopping.max_new_tokens
    if n == 0 or new < 1:
        raise RequestRejected("a request needs at least one prompt token and max_new_tokens >= 1")
    max_in, max_total = serving.max_input_tokens, serving.max_total_tokens
    if max_in and n > max_in:
        raise RequestRejected(f"prompt has {n} tokens, more than the limit of {max_in}")
    if max_total and n + new > max_total:
        raise RequestRejected(f"prompt + max_new_tokens = {n + new} exceeds the limit of {max_total}")
    if serving.min_kv_tokens < request_blocks(request, 1):
        raise RequestRejected("request needs more KV pages than a replica has", 400)


def _alive(state: RequestState) -> Callable[[], bool]:
    """The queue's liveness probe of one request."""
    return lambda: state.alive
