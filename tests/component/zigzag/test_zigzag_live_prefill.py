"""Layer-level live prefill: batches start on a replica still receiving weights (regions delivered one
by one under test control), one is relayed after k layers to the old replica, which finishes it from
the received activation; the split KV ([0, k) new, [k, L) old) is migrated in two halves to a third
replica, which decodes exactly transformers' tokens. Page accounting is exact on every replica; the
old replica's pages of a relayed prompt never join its prefix cache."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos import generate_pb2 as pb
from tests.helpers.eventually import eventually
from tests.helpers.weights_cluster import (
    CALL_TIMEOUT,
    InProcReplica,
    decode_to_end,
    make_batch,
    prompts_for,
    reference,
    weights_cluster,
)

LAYERS, SPLIT, MAX_NEW = 4, 2, 5


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="llama", layers=LAYERS)


def deliver(source: InProcReplica, target: InProcReplica, regions: range) -> None:
    """Copy weight regions (layout order: embed, layers, head) and mark them landed, as a transfer would."""
    src, dst = source.weights.params, target.weights.params
    for index in regions:
        region = dst.layout.regions[index]
        dst.buffer[region.offset : region.end].copy_(src.buffer[region.offset : region.end])
        dst.mark_region(index)


def zag_async(replica: InProcReplica, batch: pb.Batch, seq: int) -> Future[pb.PrefillV2Response]:
    """ZagPrefill on a thread (it returns only when the batch finished or was relayed)."""
    future: Future[pb.PrefillV2Response] = Future()
    request = pb.ZagPrefillRequest(batch=batch, forward_case=pb.NAIVE_PP, zag_layers=1, zag_seq_num=seq)
    request.pp_info.embedding_layer = 1

    def run() -> None:
        try:
            future.set_result(replica.stub.ZagPrefill(request, timeout=CALL_TIMEOUT))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def wait_layers(replica: InProcReplica, layers: list[int]) -> None:
    """Until the queued tasks (in order) have run exactly `layers` layers each."""
    def queued() -> list[int]:
        return [t.layer for t in list(replica.weights.zigzag.tasks)]

    eventually(lambda: queued() == layers, 30, message=lambda: f"layers {layers} run (queued: {queued()})")


def migrate_halves(
    batch: pb.Batch, new: InProcReplica, old: InProcReplica, dst: InProcReplica
) -> pb.CachedBatch:
    """Layers [0, k) from the new replica and [k, L) from the old one into `dst` (four calls at once)."""
    calls: list[tuple[Callable[..., Any], Any]] = []
    for half, src in ((pb.PARTIAL_CASE_FIRST, new), (pb.PARTIAL_CASE_SECOND, old)):
        fields: dict[str, Any] = {
            "batch": batch,
            "fst_or_snd": half,
            "num_layer": SPLIT,
            "src": [src.rank],
            "dst": [dst.rank],
        }
        calls.append((src.stub.MigratePartial, pb.MigratePartialRequest(**fields)))
        calls.append((dst.stub.ImmigratePartial, pb.ImmigratePartialRequest(**fields)))
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(method, request, timeout=CALL_TIMEOUT) for method, request in calls]
        responses = [f.result() for f in futures]
    return responses[3].batch  # SECOND's receiver answer: the decode-ready batch


def test_batch_relayed_after_k_layers_finishes_on_old_replica(model: Path, tmp_path: Path) -> None:
    prompts = prompts_for(512, count=3, seed=9)
    want = reference(model, prompts, MAX_NEW)
    with weights_cluster(model, tmp_path, 3, inactive=[1]) as (old, new, third):
        start_free = [r.free_blocks() for r in (old, new, third)]
        second = zag_async(new, make_batch(2, prompts[2:], MAX_NEW), seq=1)  # waits for seq 0
        first = zag_async(new, make_batch(1, prompts[:2], MAX_NEW), seq=0)
        wait_layers(new, [])  # nothing can run: no weight yet
        deliver(old, new, range(0, 1 + SPLIT))  # embed + layers [0, SPLIT)
        wait_layers(new, [SPLIT, SPLIT])
        assert new.health() == "loading"

        relay = new.stub.Relay(pb.RelayRequest(rank=old.rank), timeout=CALL_TIMEOUT)
        assert (relay.batch_id, relay.seq_num) == (1, 0)
        relayed = first.result(CALL_TIMEOUT)
        assert relayed.pp_info.WhichOneof("start_layer") == "tfm_layer"
        assert (relayed.pp_info.tfm_layer, list(relayed.pp_info.num_layer_per_rank)) == (SPLIT, [SPLIT])
        assert relayed.batch.id == 1 and not relayed.generations

        finish = pb.PrefillV2Request(
            batch=make_batch(1, prompts[:2], MAX_NEW),
            forward_case=pb.NAIVE_PP | pb.IMMIGRATE,
            pp_info=relayed.pp_info,
            pipe_peer=[new.rank],
        )
        done = old.stub.PrefillV2(finish, timeout=CALL_TIMEOUT)
        assert not done.HasField("pp_info")
        tokens = {g.request_id: list(g.tokens.ids) for g in done.generations}
        assert [tokens[100], tokens[101]] == [w[:1] for w in want[:2]]

        # the KV is split: [0, k) on the new replica, [k, L) on the old one; a third one decodes
        merged = migrate_halves(make_batch(1, prompts[:2], MAX_NEW), new, old, third)
        first_tokens = pb.Tokens(ids=[tokens[100][0], tokens[101][0]])
        decode_to_end(third.stub, merged, tokens, first_tokens)
        assert [tokens[100], tokens[101]] == want[:2]
        # the old replica wrote only layers [k, L) of those pages: none joins its prefix cache (a
        # later prompt with that prefix, e.g. the same request re-run, would read stale layers)
        assert not old.stub.Info(pb.InfoRequest(), timeout=CALL_TIMEOUT).cached_page_hashes

        assert not second.done()  # batch 2 waits for the rest of the weights
        deliver(old, new, range(1 + SPLIT, LAYERS + 2))
        finished = second.result(CALL_TIMEOUT)
        assert not finished.HasField("pp_info")
        assert new.health() == "serving"
        tokens = {g.request_id: list(g.tokens.ids) for g in finished.generations}
        decode_to_end(new.stub, finished.batch, tokens)
        assert tokens[200] == want[2]
        assert [r.free_blocks() for r in (old, new, third)] == start_free


def test_relay_unstarted_non_head_and_nothing(model: Path, tmp_path: Path) -> None:
    prompts = prompts_for(512, count=2, seed=3)
    want = reference(model, prompts, 1)
    with weights_cluster(model, tmp_path, 2, inactive=[1]) as (old, new):
        start_free = [old.free_blocks(), new.free_blocks()]
        empty = new.stub.Relay(pb.RelayRequest(rank=old.rank), timeout=CALL_TIMEOUT)
        assert not empty.HasField("batch_id") and not empty.HasField("seq_num")
        head = zag_async(new, make_batch(1, prompts[:1], 1), seq=0)
        tail = zag_async(new, make_batch(2, prompts[1:], 1), seq=1)
        wait_layers(new, [-1, -1])

        relax = new.stub.Relay(pb.RelayRequest(rank=old.rank, relax_not_head=True), timeout=CALL_TIMEOUT)
        assert (relax.batch_id, relax.seq_num) == (2, 1)  # the first non-head task
        unstarted = tail.result(CALL_TIMEOUT)
        assert unstarted.pp_info.WhichOneof("start_layer") == "embedding_layer"
        new.stub.ClearCache(pb.ClearCacheRequest(id=2), timeout=CALL_TIMEOUT)
        again = pb.PrefillV2Request(
            batch=make_batch(2, prompts[1:], 1),
            forward_case=pb.NAIVE_PP | pb.IMMIGRATE,
            pp_info=unstarted.pp_info,
            pipe_peer=[new.rank],
        )
        for case in (pb.NAIVE_PP, pb.IMMIGRATE, pb.NAIVE_PP | pb.IMMIGRATE | pb.MIGRATE):
            malformed = pb.PrefillV2Request(batch=again.batch, forward_case=case, pipe_peer=[new.rank])
            with pytest.raises(grpc.RpcError) as bad:
                old.stub.PrefillV2(malformed, timeout=CALL_TIMEOUT)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        done = old.stub.PrefillV2(again, timeout=CALL_TIMEOUT)  # embeds locally, runs every layer
        assert [list(g.tokens.ids) for g in done.generations] == [want[1]]

        nothing = new.stub.Relay(pb.RelayRequest(rank=old.rank, relax_not_head=True), timeout=CALL_TIMEOUT)
        assert not nothing.HasField("batch_id")  # only the head is left, and relax never takes it
        with pytest.raises(grpc.RpcError) as refused:
            new.stub.PrefillV2(pb.PrefillV2Request(batch=make_batch(3, prompts[:1], 1)), timeout=CALL_TIMEOUT)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        deliver(old, new, range(0, LAYERS + 2))
        assert [list(g.tokens.ids) for g in head.result(CALL_TIMEOUT).generations] == [want[0]]
        assert [old.free_blocks(), new.free_blocks()] == start_free


def test_zag_batch_advances_as_a_real_transfer_lands(model: Path, tmp_path: Path) -> None:
    prompts = prompts_for(512, count=2, seed=21)
    want = reference(model, prompts, MAX_NEW)
    with weights_cluster(model, tmp_path, 2, inactive=[1], link_gbps=0.02) as (old, new):  # ~0.35 s
        start_free = new.free_blocks()
        pending = zag_async(new, make_batch(1, prompts, MAX_NEW), seq=0)
        wait_layers(new, [-1])
        new.stub.RecvParams(pb.RecvParamsRequest(src=old.rank), timeout=CALL_TIMEOUT)
        old.stub.SendParams(pb.SendParamsRequest(dst=new.rank), timeout=CALL_TIMEOUT)
        finished = pending.result(CALL_TIMEOUT)  # stepped layer by layer from the transfer's region callbacks
        for replica in (old, new):
            replica.stub.WaitRdmaDone(pb.WaitRdmaDoneRequest(), timeout=CALL_TIMEOUT)
        assert not finished.HasField("pp_info")
        tokens = {g.request_id: list(g.tokens.ids) for g in finished.generations}
        decode_to_end(new.stub, finished.batch, tokens)
        assert [tokens[100], tokens[101]] == want
        assert new.free_blocks() == start_free


def test_zag_caller_gives_up_and_order_violations(model: Path, tmp_path: Path) -> None:
    prompts = prompts_for(512, count=1, seed=4)
    with weights_cluster(model, tmp_path, 1, inactive=[0]) as (new,):
        start_free = new.free_blocks()
        request = pb.ZagPrefillRequest(
            batch=make_batch(1, prompts, 3), forward_case=pb.NAIVE_PP, zag_seq_num=0
        )
        with pytest.raises(grpc.RpcError) as gave_up:  # no weight ever arrives
            new.stub.ZagPrefill(request, timeout=1.0)
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_layers(new, [])  # the task is dropped on the engine thread ...
        assert new.free_blocks() == start_free  # ... with its pages
        stale = pb.ZagPrefillRequest(batch=make_batch(2, prompts, 3), forward_case=pb.NAIVE_PP, zag_seq_num=0)
        pending = zag_async(new, make_batch(3, prompts, 3), seq=0)  # an empty queue: a new episode
        wait_layers(new, [-1])
        with pytest.raises(grpc.RpcError) as again:
            new.stub.ZagPrefill(stale, timeout=CALL_TIMEOUT)  # seq 0 was admitted already
        assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        not_naive = pb.ZagPrefillRequest(batch=make_batch(4, prompts, 3), zag_seq_num=1)
        with pytest.raises(grpc.RpcError) as wrong:
            new.stub.ZagPrefill(not_naive, timeout=CALL_TIMEOUT)
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        new.stub.Relay(pb.RelayRequest(rank=new.rank), timeout=CALL_TIMEOUT)  # unstarted: no activation
        assert pending.result(CALL_TIMEOUT).pp_info.embedding_layer == 1
        new.stub.ClearCache(pb.ClearCacheRequest(id=3), timeout=CALL_TIMEOUT)
        assert new.free_blocks() == start_free
