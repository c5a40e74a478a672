"""The fake replica's batches and pages: the engine's rules (replica/engine) over a one-line model.

The "model": the next token is `(previous * 7 + 3) % VOCAB`; token i prints "<i>". Admission,
page reservation (prompt + max_new_tokens), finishing, filtering and clearing follow the real
engine, refusals included, so `num_blocks_free` and every status code match a real replica's
(tests/component/router/test_fake_replica_conformance.py checks it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

from protos import generate_pb2 as pb
from tests.helpers.fake_errors import Refused

VOCAB = 97
MAX_TOTAL_TOKENS = 512  # the tiny test checkpoint's positions (its real replicas say the same)
NUM_LAYERS = 2
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


def next_token(prev: int) -> int:
    """The fake model."""
    return (prev * 7 + 3) % VOCAB


def expected_tokens(prompt: Iterable[int], n: int) -> list[int]:
    """What the fake model generates greedily after `prompt` (no EOS)."""
    out, last = [], list(prompt)[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


@dataclass
class FakeRequest:
    """One request's state on a fake replica."""

    id: int
    tokens: list[int]
    max_new: int
    pages: int
    generated: int = 0
    done: bool = False
    ignore_eos: bool = False


def _finished(req: FakeRequest, reason: int) -> pb.GeneratedText:
    req.done = True
    text = "".join(f"<{t}>" for t in req.tokens[len(req.tokens) - req.generated:])
    return pb.GeneratedText(text=text, generated_tokens=req.generated, finish_reason=reason)  # type: ignore[arg-type]


class FakeBatches:
    """Cached batches by id and the page count of one fake replica."""

    def __init__(self, num_blocks: int, block_size: int, eos: int | None,
                 max_total_tokens: int = MAX_TOTAL_TOKENS) -> None:
        self.num_blocks, self.block_size, self.eos = num_blocks, block_size, eos
        self.max_total_tokens = max_total_tokens
        self.max_input_tokens = max_total_tokens - 1
        self.free = num_blocks
        self.batches: dict[int, list[FakeRequest]] = {}

    # ---------------------------------------------------------------------- admission
    def admit(self, batch: pb.Batch) -> list[FakeRequest]:
        """Check a new batch as the engine does and reserve its pages (all or nothing)."""
        if batch.id in self.batches:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"batch {batch.id} is already cached")
        ids = [r.id for r in batch.requests]
        taken = {q.id for reqs in self.batches.values() for q in reqs}
        if set(ids) & taken:
            raise Refused(INVALID, f"request ids {sorted(set(ids) & taken)} are already in a cached batch")
        if not ids or len(set(ids)) != len(ids):
            raise Refused(INVALID, f"batch {batch.id} has no requests or lists one twice")
        reqs = [self._request(r) for r in batch.requests]
        need = sum(q.pages for q in reqs)
        if need > self.free:
            raise Refused(EXHAUSTED, f"need {need} KV pages, {self.free} free")
        self.free -= need
        return reqs

    def _request(self, r: pb.Request) -> FakeRequest:
        max_new = r.stopping_parameters.max_new_tokens
        tokens = list(r.input_tokens)
        if r.truncate and len(tokens) > r.truncate:
            tokens = tokens[-r.truncate:]
        if max_new <= 0 or not tokens or not all(0 <= t < VOCAB for t in tokens):
            raise Refused(INVALID, f"request {r.id}: no max_new_tokens, an empty prompt or a token outside "
                                   "the vocabulary")
        if len(tokens) > self.max_input_tokens or len(tokens) + max_new > self.max_total_tokens:
            raise Refused(EXHAUSTED, f"request {r.id}: over max_input_tokens or max_total_tokens")
        pages = -(-(len(tokens) + max_new) // self.block_size)
        return FakeRequest(r.id, tokens, max_new, pages, ignore_eos=r.stopping_parameters.ignore_eos_token)

    # ------------------------------------------------------------------------- steps
    def advance(self, req: FakeRequest) -> pb.Generation:
        """One token of the fake model for `req`."""
        tok = next_token(req.tokens[-1])
        req.tokens.append(tok)
        req.generated += 1
        tokens = pb.Tokens(ids=[tok], logprobs=[-0.5], texts=[f"<{tok}>"], is_special=[False])
        gen = pb.Generation(request_id=req.id, tokens=tokens)
        if req.generated >= req.max_new:
            gen.generated_text.CopyFrom(_finished(req, pb.FINISH_REASON_LENGTH))
        elif tok == self.eos and not req.ignore_eos:
            gen.generated_text.CopyFrom(_finished(req, pb.FINISH_REASON_EOS_TOKEN))
        return gen

    def append(self, req: FakeRequest, tok: int) -> pb.Generation | None:
        """A token generated elsewhere (DecodeV2's last_iter_tokens); a Generation only if it finished."""
        req.tokens.append(tok)
        req.generated += 1
        if req.generated < req.max_new:
            return None
        return pb.Generation(request_id=req.id, tokens=pb.Tokens(),
                             generated_text=_finished(req, pb.FINISH_REASON_LENGTH))

    def keep(self, batch_id: int, reqs: list[FakeRequest]) -> pb.CachedBatch | None:
        """Cache a batch that still runs; drop (and free) one whose requests all finished."""
        if all(r.done for r in reqs):
            self.batches.pop(batch_id, None)
            self.give_back(reqs)
            return None
        self.batches[batch_id] = reqs
        return self.cached(batch_id)

    def merge(self, batches: Sequence[pb.CachedBatch], last: Sequence[pb.Tokens]
              ) -> tuple[int, list[FakeRequest], list[pb.Generation]]:
        """DecodeV2's merge: the batches under the first id, their last tokens appended."""
        ids = [b.id for b in batches]
        if not ids or len(set(ids)) != len(ids):
            raise Refused(INVALID, f"decode needs distinct batches, got {ids}")
        missing = [i for i in ids if i not in self.batches]
        if missing:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"batch {missing[0]} is not cached")
        if last and len(last) != len(ids):
            raise Refused(INVALID, f"{len(last)} last_iter_tokens entries for {len(ids)} batches")
        for bid, tokens in zip(ids, last, strict=False):
            if tokens.ids and len(tokens.ids) != len(self.batches[bid]):
                raise Refused(INVALID, f"batch {bid}: {len(tokens.ids)} last_iter_tokens for "
                                       f"{len(self.batches[bid])} requests")
        merged: list[FakeRequest] = []
        appended: list[pb.Generation] = []
        for i, bid in enumerate(ids):
            reqs = self.batches.pop(bid)
            for req, tok in zip(reqs, last[i].ids if i < len(last) else (), strict=False):
                gen = None if req.done else self.append(req, tok)
                appended += [gen] if gen is not None else []
            merged += reqs
        self.batches[ids[0]] = merged
        return ids[0], merged, appended

    # ----------------------------------------------------------------- filter and clear
    def filter(self, batch_id: int, keep: Sequence[int]) -> pb.CachedBatch:
        """Keep only `keep` (NOT_FOUND, or INVALID_ARGUMENT for an id not in the batch)."""
        reqs = self.get(batch_id)
        missing = [i for i in keep if i not in {r.id for r in reqs}]
        if missing:
            raise Refused(INVALID, f"requests {missing} are not in batch {batch_id}")
        self.give_back([r for r in reqs if r.id not in keep])
        self.batches[batch_id] = [r for r in reqs if r.id in keep]
        info = self.cached(batch_id)
        if not keep:
            del self.batches[batch_id]
        return info

    def clear(self, batch_id: int | None) -> None:
        """Free one batch (NOT_FOUND if unknown) or every batch."""
        for bid in [batch_id] if batch_id is not None else list(self.batches):
            self.get(bid)
            self.give_back(self.batches.pop(bid))

    # ------------------------------------------------------------------------- facts
    def get(self, batch_id: int) -> list[FakeRequest]:
        """A cached batch's requests, or NOT_FOUND."""
        if batch_id not in self.batches:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"batch {batch_id} is not cached")
        return self.batches[batch_id]

    def cached(self, batch_id: int) -> pb.CachedBatch:
        """A cached batch as the caller sees it."""
        reqs = self.batches[batch_id]
        return pb.CachedBatch(id=batch_id, request_ids=[r.id for r in reqs], size=len(reqs),
                              max_tokens=sum(r.pages for r in reqs) * self.block_size)

    def give_back(self, reqs: Iterable[FakeRequest]) -> None:
        """Free the pages of `reqs`."""
        self.free += sum(r.pages for r in reqs)
