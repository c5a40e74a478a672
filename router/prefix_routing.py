"""Cache-aware routing, wired: which queued prompt a replica's loop should take, and what the
router learns of each replica's prefix cache.

```
 take_batch(R) ─► wants(R, entry): choose() over the prefill candidates ─► take it, or leave it
                   (routing.py: the rule)           ▲                      for the replica chosen
 destination(batch, decode replicas) ─► a prefilled batch's decode replica, the same rule
 prefilled(R, members, result) ─► PrefixIndex.add / evict (prefix_index.py) + hit-rate metrics
 migrated(R, members) ─► add (KV arrived)
 stepped(R, result) ─► evict;  info(R) ─► rebuild from Info.cached_page_hashes;  dead(R) ─► drop
```
The router keeps one FIFO queue that every prefill loop takes from (queue.py), so the rule is
applied at batch time: a loop passes over a prompt whose best replica is another one (its prefix is
cached there and that replica is not over the load bound), leaving it in place, and wakes that
replica's loop. One queue rather than one per replica keeps a dead or draining replica from
stranding prompts, and the decision sees every replica's load at the moment a batch is cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from router.batches import Member
from router.metrics import RouterMetrics
from router.page_hash import prompt_page_hashes
from router.prefix_index import PrefixIndex
from router.queue import QueueEntry, request_blocks
from router.replicas import ReplicaState, State
from router.routing import Candidate, Routing, choose
from router.types import ReplicaId, ReplicaInfo, RequestId, StepResult

_MAX_MEMO = 1 << 14  # requests whose page hashes are kept between batch cuts


class PrefixRouting:
    """The prefix index, the routing rule and the memo of each queued prompt's page hashes."""

    def __init__(self, routing: Routing, max_load: int, metrics: RouterMetrics,
                 index: PrefixIndex | None = None) -> None:
        self.routing = routing
        self.max_load = max_load
        self.metrics = metrics
        self.index = index or PrefixIndex()
        self._memo: dict[tuple[RequestId, int, int], tuple[int, ...]] = {}

    def hashes(self, request_id: RequestId, tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
        """The prompt's full-page hashes (memoized per request, prompt length and page size)."""
        key = (request_id, len(tokens), block_size)
        found = self._memo.get(key)
        if found is None:
            if len(self._memo) >= _MAX_MEMO:
                self._memo.clear()
            found = self._memo[key] = prompt_page_hashes(tokens, block_size)
        return found

    def choice(self, entry: QueueEntry, candidates: Sequence[ReplicaState],
               queued: Mapping[ReplicaId, int] | None = None) -> Candidate | None:
        """Where `entry`'s prefill should run among `candidates` (None: no candidate); a replica's
        load is the requests it holds pages for and the `queued` ones ahead of `entry` going to it."""
        queued = queued or {}
        cands = []
        for rep in candidates:
            hashes = self.hashes(entry.request_id, entry.request.input_ids, rep.info.block_size)
            cached = self.index.cached_pages(rep.id, hashes)
            if rep.free_blocks < request_blocks(entry.request, rep.info.block_size):
                cached = 0  # no room for it now: its prefix there is not worth waiting for
            cands.append(Candidate(rep.id, cached, len(rep.held) + queued.get(rep.id, 0)))
        return choose(cands, self.routing, self.max_load)

    def wants(self, replica: ReplicaState, candidates: Sequence[ReplicaState],
              wake: Callable[[ReplicaId], None]) -> Callable[[QueueEntry], bool]:
        """The queue's filter for `replica`'s next batch: True for the prompts it should take; a
        prompt left for another replica wakes that replica's loop. The prompts ahead in the queue
        count in the load of the replica each goes to, so a prefix every prompt shares does not
        leave a burst waiting for one replica while this one could take them."""
        if self.routing is Routing.LOAD or len(candidates) < 2:
            return lambda entry: True
        woken: set[ReplicaId] = set()
        queued: dict[ReplicaId, int] = {}

        def accept(entry: QueueEntry) -> bool:
            best = self.choice(entry, candidates, queued)
            # only a cached prefix is worth waiting for; an even load split is the least loaded's
            if best is None or best.replica == replica.id or best.cached_pages == 0:
                queued[replica.id] = queued.get(replica.id, 0) + 1
                return True
            queued[best.replica] = queued.get(best.replica, 0) + 1
            if best.replica not in woken:
                woken.add(best.replica)
                wake(best.replica)
            return False

        return accept

    def destination(self, members: Iterable[Member], receivers: Sequence[ReplicaState], need: int,
                    max_inbound: int, chosen: ReplicaState) -> ReplicaState:
        """A prefilled batch's decode replica: among the decode replicas with room for it (`need`
        pages, an inbound slot), the one holding the longest cached prefix of its prompts (summed)
        under the load bound; `chosen` (the strategy's pick) when none holds any, or under `load`."""
        fits = [r for r in receivers
                if r.role is State.DECODE and r.inbound < max_inbound and r.free_blocks >= need]
        if self.routing is Routing.LOAD or len(fits) < 2:
            return chosen
        prompts = [(m.state.id, m.request.input_ids) for m in members]

        def held(r: ReplicaState) -> int:
            return sum(self.index.cached_pages(r.id, self.hashes(rid, tokens, r.info.block_size))
                       for rid, tokens in prompts)

        cands = [Candidate(r.id, held(r), len(r.held)) for r in fits]
        best = choose(cands, self.routing, self.max_load)
        if best is None or best.cached_pages == 0:
            return chosen
        return next(r for r in fits if r.id == best.replica)

    def prefilled(self, replica: ReplicaState, members: Iterable[Member], result: StepResult) -> None:
        """`replica` prefilled these members: it holds their full prompt pages now (when its prefix
        cache is on); count the prompt tokens and those it took from its cache."""
        self.stepped(replica.id, result)
        cached = {g.request_id: g.cached_tokens for g in result.generations}
        prompt = hit = 0
        for m in members:
            tokens = m.request.input_ids
            if replica.info.prefix_cache:
                self.index.add(replica.id, self.hashes(m.state.id, tokens, replica.info.block_size))
            prompt += len(tokens)
            hit += cached.get(m.state.id, 0)
        self.metrics.prefix_cache(str(replica.id), prompt, hit)

    def migrated(self, replica: ReplicaState, members: Iterable[Member], evicted: Sequence[int]) -> None:
        """These members' prompt KV arrived on `replica`: it holds their full prompt pages now (when
        its prefix cache is on), less what it reports evicted."""
        self.index.evict(replica.id, evicted)
        if replica.info.prefix_cache:
            block = replica.info.block_size
            for m in members:
                self.index.add(replica.id, self.hashes(m.state.id, m.request.input_ids, block))

    def stepped(self, replica: ReplicaId, result: StepResult) -> None:
        """A call on `replica` answered: drop the pages it reports evicted."""
        if result.evicted_page_hashes:
            self.index.evict(replica, result.evicted_page_hashes)

    def info(self, replica: ReplicaId, info: ReplicaInfo) -> None:
        """`replica` (re)registered or was polled: its Info lists every page it holds."""
        self.index.reset(replica, info.cached_page_hashes if info.prefix_cache else ())

    def dead(self, replica: ReplicaId) -> None:
        """`replica` died or left: it holds nothing any more."""
        self.index.drop(replica)
