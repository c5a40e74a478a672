"""In-process replicas for the KV migration tests, and the router-like moves they check.

    with migration_cluster(model, tmp_path, 3, num_blocks=64) as (a, b, d):
        first = prefill(a, batch)
        pair(lambda: migrate(a, batch, d.rank), lambda: immigrate(d, batch, a.rank))

The replicas come from `tests.helpers.inproc_cluster` (what `serve()` runs, in this process, all
ranks in one rank table file). Also: greedy generation by transformers for the reference tokens,
decoding over gRPC until every request finished, page accounting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
import pytest
import torch

from protos import generate_pb2 as pb
from tests.helpers.engine_driver import reference_greedy
from tests.helpers.inproc_cluster import CALL_TIMEOUT as CALL_TIMEOUT
from tests.helpers.inproc_cluster import InProcReplica as InProcReplica
from tests.helpers.inproc_cluster import inproc_cluster
from tests.helpers.inproc_cluster import write_rank_table as write_rank_table

T = TypeVar("T")
U = TypeVar("U")

Replica = InProcReplica  # one in-process replica: rank, stub, channel, services


@contextlib.contextmanager
def migration_cluster(
    model: Path, tmp_path: Path, n: int, per_rank: dict[int, dict[str, Any]] | None = None, **config: Any
) -> Iterator[list[Replica]]:
    """`n` replicas of `model` in this process (`per_rank[r]` overrides rank r's config); stopped on exit."""

    def config_for(rank: int) -> dict[str, Any]:
        return {**config, **(per_rank or {}).get(rank, {})}

    with inproc_cluster(model, tmp_path, n, config_for) as replicas:
        yield replicas


def make_batch(batch_id: int, prompts: list[list[int]], max_new: list[int], first_id: int = 0) -> pb.Batch:
    """A greedy batch of token prompts."""
    requests = [
        pb.Request(
            id=first_id + i,
            input_tokens=p,
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=n, ignore_eos_token=True),
        )
        for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))
    ]
    return pb.Batch(id=batch_id, requests=requests, size=len(requests))


def random_prompts(vocab: int, lengths: list[int], seed: int = 5) -> list[list[int]]:
    """Prompts of the given lengths, ids in [3, vocab)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def reference(model: Path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Transformers' greedy continuation of each prompt (EOS ignored, like the batches here)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    return [reference_greedy(hf, p, n, ignore_eos=True)[0] for p, n in zip(prompts, max_new, strict=True)]


def pair(first: Callable[[], T], second: Callable[[], U]) -> tuple[T, U]:
    """Run two calls concurrently (a sender and a receiver) and return both results (or raise)."""
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(first), pool.submit(second)
        return a.result(timeout=CALL_TIMEOUT * 2), b.result(timeout=CALL_TIMEOUT * 2)


def first_tokens(generations: Any) -> dict[int, list[int]]:
    """Request id -> generated token ids so far."""
    return {g.request_id: list(g.tokens.ids) for g in generations}


def decode_to_end(
    replica: Replica, cached: pb.CachedBatch, tokens: dict[int, list[int]], last: list[int] | None
) -> dict[int, list[int]]:
    """DecodeV2 (appending `last` first) until every request finished; filter finished ones out."""
    batch: pb.CachedBatch | None = cached
    appended = [pb.Tokens(ids=last)] if last is not None else []
    while batch is not None:
        resp = replica.stub.DecodeV2(
            pb.DecodeV2Request(batches=[batch], last_iter_tokens=appended), timeout=CALL_TIMEOUT
        )
        appended = []
        done = []
        for g in resp.generations:
            tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
            if g.HasField("generated_text"):
                done.append(g.request_id)
        batch = resp.batch if resp.HasField("batch") else None
        if batch is not None and done:
            keep = [r for r in batch.request_ids if r not in done]
            filtered = replica.stub.FilterBatch(
                pb.FilterBatchRequest(batch_id=batch.id, request_ids=keep), timeout=CALL_TIMEOUT
            )
            batch = filtered.batch if keep else None
    return tokens


def code_and_cause(call: Callable[[], object]) -> tuple[grpc.StatusCode, str | None]:
    """The code of a call that must fail, and its `x-pdcluster-cause` (set when a replica blames
    its peer)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    failed = cast(grpc.Call, info.value)
    cause = dict(failed.trailing_metadata() or ()).get("x-pdcluster-cause")
    return failed.code(), None if cause is None else str(cause)
