"""Per-rank KV migration between `pdcluster replica --tp 2` processes: tp_rank i sends its shard
to tp_rank i of the receiver over its own fabric endpoint (global rank of the group's rank 0 + i).

One rank table: A = ranks 0-1, B = ranks 2-3, E = ranks 4-5 (tp 2), C = rank 6 (tp 1). A prefills,
the batch's KV moves A → B (Migrate ‖ Immigrate), B decodes: every token equals transformers' greedy
one (rank 1's shard holds half the KV heads, so a shard that did not move changes the tokens). The
partial halves: layers [0, 1) from A and [1, L) from E into one batch on B.
Every page is free again on both sides afterwards. A tp 2 ↔ tp 1 migration fails
FAILED_PRECONDITION on both sides, naming both sizes. Last, every router strategy over A and B.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from protos import generate_pb2 as pb
from router import strategies
from router.main import kv_bytes_per_token
from router.replicas import State
from router.tokenizer import Tokenizer
from tests.helpers.migration_cluster import (
    decode_to_end,
    first_tokens,
    make_batch,
    pair,
    random_prompts,
    reference,
)
from tests.helpers.recording_client import recording_connect
from tests.helpers.router_core import collect, config, greedy, pages_back, run, scheduler, tokens_of
from tests.helpers.router_core import request as route_request
from tests.helpers.tp_replicas import TIMEOUT, Group, Proc, tp_replicas

pytest.importorskip("transformers")
LENGTHS = [1, 7, 9, 17]  # pages of 4 tokens: partial, multi-page prompts
MAX_NEW = [4, 3, 5, 2]


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", kv_heads=2, seed=31)


@pytest.fixture(scope="module")
def replicas(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    groups = [Group(0, 2), Group(2, 2), Group(4, 2), Group(6, 1)]
    with tp_replicas(model, tmp_path_factory.mktemp("tpmig"), groups) as procs:
        yield procs


def _move(a: Proc, b: Proc, batch: pb.Batch) -> tuple[pb.CachedBatch, pb.ImmigrateResponse]:
    sent, got = pair(
        lambda: a.stub.Migrate(pb.MigrateRequest(batch=batch, src=[a.rank], dst=[b.rank]), timeout=TIMEOUT),
        lambda: b.stub.Immigrate(pb.ImmigrateRequest(batch=batch, src=[a.rank], dst=[b.rank, b.rank + 1]),
                                 timeout=TIMEOUT),
    )
    return sent.batch, got


def test_tp2_to_tp2_migration_decodes_transformers_tokens(model: Path, replicas: list[Proc]) -> None:
    a, b, _, _ = replicas
    prompts = random_prompts(256, LENGTHS, seed=9)
    batch = make_batch(1, prompts, MAX_NEW)
    first = a.stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=TIMEOUT)
    _, got = _move(a, b, batch)
    tokens = first_tokens(first.generations)
    last = [tokens[r][0] for r in got.batch.request_ids]
    decoded = decode_to_end(cast(Any, b), got.batch, tokens, last)  # it needs the stub only
    assert [decoded[i] for i in range(len(prompts))] == reference(model, prompts, MAX_NEW)
    for proc in (a, b):
        proc.check_all_free()


def test_tp2_partial_halves_from_two_senders_decode_transformers_tokens(
    model: Path, replicas: list[Proc]
) -> None:
    a, b, e, _ = replicas
    prompts = random_prompts(256, LENGTHS, seed=11)
    batch = make_batch(31, prompts, MAX_NEW, first_id=10)
    first = a.stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=TIMEOUT)
    e.stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=TIMEOUT)

    def half(sender: Proc, case: pb.PartialCase) -> Callable[[], pb.MigrateResponse]:
        request = pb.MigratePartialRequest(batch=batch, fst_or_snd=case, num_layer=1, src=[sender.rank],
                                           dst=[b.rank])
        return lambda: sender.stub.MigratePartial(request, timeout=TIMEOUT)

    def receive(sender: Proc, case: pb.PartialCase) -> Callable[[], pb.ImmigrateResponse]:
        request = pb.ImmigratePartialRequest(batch=batch, fst_or_snd=case, num_layer=1, src=[sender.rank],
                                             dst=[b.rank])
        return lambda: b.stub.ImmigratePartial(request, timeout=TIMEOUT)

    (_, second), _ = pair(
        lambda: pair(half(e, pb.PARTIAL_CASE_SECOND), receive(e, pb.PARTIAL_CASE_SECOND)),
        lambda: pair(half(a, pb.PARTIAL_CASE_FIRST), receive(a, pb.PARTIAL_CASE_FIRST)),
    )
    tokens = first_tokens(first.generations)
    last = [tokens[r][0] for r in second.batch.request_ids]
    decoded = decode_to_end(cast(Any, b), second.batch, tokens, last)
    assert [decoded[10 + i] for i in range(len(prompts))] == reference(model, prompts, MAX_NEW)
    for proc in (a, b, e):
        proc.check_all_free()


def _errors(*calls: Callable[[], object]) -> list[grpc.RpcError]:
    """Run the calls concurrently; each must fail: their errors."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
    errors = [future.exception(timeout=0) for future in futures]
    assert all(isinstance(e, grpc.RpcError) for e in errors), errors
    return cast(list[grpc.RpcError], errors)


@pytest.mark.parametrize("direction", ["tp2->tp1", "tp1->tp2"])
def test_migration_between_different_tp_is_refused(replicas: list[Proc], direction: str) -> None:
    a, _, _, c = replicas
    src, dst = (a, c) if direction == "tp2->tp1" else (c, a)
    batch = make_batch(5, random_prompts(256, [6], seed=3), [2], first_id=50)
    src.stub.PrefillV2(pb.PrefillV2Request(batch=batch), timeout=TIMEOUT)
    errors = _errors(
        lambda: src.stub.Migrate(pb.MigrateRequest(batch=batch, src=[src.rank], dst=[dst.rank]),
                                 timeout=TIMEOUT),
        lambda: dst.stub.Immigrate(pb.ImmigrateRequest(batch=batch, src=[src.rank], dst=[dst.rank]),
                                   timeout=TIMEOUT),
    )
    for error in errors:
        assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, error
        assert "tp 1 vs tp 2" in str(error.details()), error.details()
    for proc in (a, c):
        proc.check_all_free()


@pytest.mark.parametrize("strategy", strategies.names())
def test_every_router_strategy_over_tp2_groups(strategy: str, model: Path, replicas: list[Proc]) -> None:
    """The router over A (prefill) and B (decode): transformers' tokens and every page back. `full`
    migrates per rank; `progressive`'s migrating prefill runs whole forwards on a tp replica and
    sends per rank after the forward; `mutate`, `recompute`, `colocated` move no KV."""
    want, (a, b) = greedy(model), replicas[:2]

    async def body() -> None:
        cfg = config(strategy, model=model)
        calls: dict[str, list[str]] = {}
        sched = scheduler(cfg, kv_bytes_per_token(model, "float32"), decoder=Tokenizer.from_model_dir(model),
                          connect=recording_connect(cfg, calls))
        try:
            for proc, role in ((a, State.PREFILL), (b, State.DECODE)):
                await sched.add_replica(proc.address, role)
            await sched.start()
            prompts = [[5 + i] * (3 + i) for i in range(4)]
            results = await asyncio.gather(*(collect(sched.submit(route_request(p, 5 + i)))
                                             for i, p in enumerate(prompts)))
            for i, (p, events) in enumerate(zip(prompts, results, strict=True)):
                assert tokens_of(events) == want(p, 5 + i), events
            await pages_back([a, b])
        finally:
            await sched.stop()
        if strategy in ("full", "progressive"):  # the KV moved (Migrate, or the migrating prefill)
            assert "Immigrate" in calls[b.address], calls
    run(body())
